"""FP8 W8A8 (Micikevicius et al. 2022): e4m3 weights with per-channel scales and per-token dynamic e4m3
activations, multiplied in scaled FP8 (torch._scaled_mm) where the hardware has it. No data needed."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from leanlm.compress.base import MethodConfig, register_method
from leanlm.compress.quantize.linear_quantizer import LinearQuantizer
from leanlm.model.linear.fp8 import FP8Linear
from leanlm.model.quantized.numerics import fp8_dtype, quantize_fp8


@dataclass(frozen=True)
class FP8Config(MethodConfig):
    fmt: str = "e4m3"  # e4m3 (weights and activations, the usual choice) or e5m2

    name = "fp8"

    def __post_init__(self) -> None:
        fp8_dtype(self.fmt)  # validates


def quantize_fp8_linear(linear: nn.Linear, fmt: str) -> FP8Linear:
    weight, scale = quantize_fp8(linear.weight, fp8_dtype(fmt), per_row=True)
    return FP8Linear(weight, scale, linear.bias)


@register_method(FP8Config)
class FP8(LinearQuantizer):
    def quantize_linear(self, linear, inputs):
        return quantize_fp8_linear(linear, self.config.fmt)
