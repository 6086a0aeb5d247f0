"""Integer quantization schemes (W8A16, W4A16 g64, W8A8 per token, ...) and the one place that turns codes
plus quantization parameters into the runtime module for a scheme. Shared by RTN, GPTQ and AWQ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import GroupInputs, LinearReport
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.w8a8 import Int8DynamicActLinear
from leanlm.model.quantized.numerics import Granularity, QParams, QuantSpec, pack_int4, sqnr_db


@dataclass(frozen=True)
class IntScheme:
    """Weights: `bits` integers per output channel, or per `group_size` input columns. Activations: 16-bit,
    or int8 per token computed on the fly (act_bits=8: W8A8, ZeroQuant)."""

    bits: int = 4
    group_size: int | None = 64  # None: one scale per output channel
    symmetric: bool | None = None  # None: symmetric for 8 bits, asymmetric (zero point) below
    act_bits: int | None = None  # None: weight-only; 8: dynamic per-token int8 activations

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.group_size is not None and (self.group_size < 32 or self.group_size % 32):
            raise ValueError(f"group_size must be a multiple of 32 (the kernels' unit), got {self.group_size}")
        if self.act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None (weight-only) or 8 (per-token int8), got {self.act_bits}")
        if self.symmetric is None:  # 5-8 bit codes are stored as signed int8: symmetric
            object.__setattr__(self, "symmetric", self.bits >= 5 or self.act_bits is not None)
        if self.act_bits is not None and (not self.symmetric or self.bits != 8):
            raise ValueError("int8 activations run int8 x int8 products: use bits=8 with symmetric weights")
        if self.act_bits is None and self.bits >= 5 and not self.symmetric:
            raise ValueError(
                f"{self.bits}-bit weight-only layers store signed int8 codes with no zero point; set symmetric=True "
                "(or use bits <= 4 for asymmetric weights)"
            )

    def spec(self, in_features: int) -> QuantSpec:
        """The weight QuantSpec for a layer with `in_features` inputs."""
        if self.group_size is None:
            return QuantSpec(self.bits, self.symmetric, Granularity.CHANNEL)
        if in_features % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide the layer's {in_features} inputs")
        return QuantSpec(self.bits, self.symmetric, Granularity.GROUP, self.group_size)

    @property
    def label(self) -> str:
        group = f" g{self.group_size}" if self.group_size else ""
        acts = f"A{self.act_bits}" if self.act_bits else "A16"
        return f"W{self.bits}{acts}{group}{'' if self.symmetric else ' asym'}"


def build_module(
    codes: torch.Tensor, qp: QParams, scheme: IntScheme, bias: torch.Tensor | None, perm: torch.Tensor | None = None
) -> RuntimeLinear:
    """Runtime module for integer codes [N, K] (from quant.quantize with scheme.spec) and their QParams."""
    n, k = codes.shape
    spec = scheme.spec(k)
    if scheme.act_bits is not None:
        return Int8DynamicActLinear(codes, qp.scale.reshape(n, -1), bias, group_size=scheme.group_size)
    if scheme.bits > 4:
        if perm is not None:
            raise ValueError("act-order permutations need group-wise 2-4 bit layers")
        if spec.group_size is None:
            return Int8WeightOnlyLinear(codes, qp.scale.reshape(n), bias)
        return Int8WeightOnlyLinear(codes, qp.scale.reshape(n, -1), bias, group_size=spec.group_size)
    # Unsigned codes with w = q * scale + min per group: symmetric codes shift by 2^(b-1).
    group_size = spec.group_size or k
    scale = qp.scale.reshape(n, k // group_size)
    if spec.symmetric:
        offset = 2 ** (scheme.bits - 1)
        unsigned, mins = codes.to(torch.int16) + offset, -offset * scale
    else:
        zero = qp.zero.reshape(n, k // group_size)
        unsigned, mins = codes.to(torch.int16), -zero * scale
    return IntGroupWeightOnlyLinear(
        pack_int4(unsigned), scale, mins, bias, bits=scheme.bits, group_size=group_size, perm=perm
    )


def linear_report(
    name: str, float_weight: torch.Tensor, module: nn.Module, inputs: GroupInputs | None, bytes_before: int
) -> LinearReport:
    """Weight SQNR, and the relative output error on the calibration sample rows (when there are any),
    activation quantization included: the module itself runs on them."""
    w_hat = module.dequantized_weight() if isinstance(module, RuntimeLinear) else module.weight.float()
    rel_error = None
    if inputs is not None and inputs.samples.numel():
        x = inputs.samples
        ref = x @ float_weight.float().t()
        out = module(x).float()
        if module.bias is not None:
            out = out - module.bias.float()
        rel_error = ((out - ref).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30)).item()
    after = module.weight_bytes() if isinstance(module, RuntimeLinear) else bytes_before
    fmt = module.format if isinstance(module, RuntimeLinear) else "float"
    sparsity = (w_hat == 0).float().mean().item()
    return LinearReport(name, fmt, rel_error, sqnr_db(float_weight, w_hat), bytes_before, after, sparsity)
