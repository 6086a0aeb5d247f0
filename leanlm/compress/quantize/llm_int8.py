"""LLM.int8() (Dettmers et al. 2022): vector-wise int8 (a scale per weight row and per token) with the
outlier feature columns, those whose calibration activations exceed `threshold`, kept in 16-bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.compress.base import NEEDS_STATS, GroupInputs, MethodConfig, register_method
from leanlm.compress.quantize.linear_quantizer import LinearQuantizer
from leanlm.model.linear.llm_int8 import LLMInt8Linear


@dataclass(frozen=True)
class LLMInt8Config(MethodConfig):
    threshold: float = 6.0  # |activation| above which a feature column is an outlier (the paper's 6.0)

    name = "llm_int8"

    def __post_init__(self) -> None:
        if self.threshold <= 0:
            raise ValueError(f"threshold must be positive, got {self.threshold}")


def llm_int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, outlier_idx: torch.Tensor, threshold: float
) -> LLMInt8Linear:
    """Split weight [N, K]: outlier columns exact, the rest int8 with absmax scales per row."""
    w = weight.float().clone()
    outlier_weight = weight[:, outlier_idx].clone()  # [N, O], bit-exact
    w[:, outlier_idx] = 0
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [N]
    qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return LLMInt8Linear(qweight, scales, outlier_idx, outlier_weight, bias, threshold=threshold)


@register_method(LLMInt8Config)
class LLMInt8(LinearQuantizer):
    needs = frozenset({NEEDS_STATS})

    def quantize_linear(self, linear, inputs: GroupInputs | None):
        if inputs is None:
            outliers = torch.zeros(0, dtype=torch.long, device=linear.weight.device)
        else:
            outliers = (inputs.absmax > self.config.threshold).nonzero().squeeze(1)
        return llm_int8_linear(linear.weight, linear.bias, outliers, self.config.threshold)
