"""Affine quantization primitives: symmetric (absmax) and asymmetric (zero-point) integers of 2-8 bits at
tensor / channel / token / group granularity, 4-bit packing, and FP8 (e4m3 / e5m2) through torch's float8
dtypes. Pure functions over tensors; every method and runtime module builds on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

GRANULARITIES = ("tensor", "channel", "token", "group")
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_EPS = 1e-12  # scale floor: an all-zero row quantizes to zeros instead of NaN


class Granularity(str, Enum):
    TENSOR = "tensor"  # one scale for the whole tensor
    CHANNEL = "channel"  # one per output channel: rows of W [N, K]
    TOKEN = "token"  # one per token: rows of X [T, K] (same math as channel, named for activations)
    GROUP = "group"  # one per `group_size` consecutive input columns of each row


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize a tensor whose last dim is the reduction (input) dim: W [N, K] or X [T, K]."""

    bits: int = 8
    symmetric: bool = True  # absmax, codes in [-(2^(b-1) - 1), 2^(b-1) - 1]; else min/max with a zero point
    granularity: Granularity = Granularity.CHANNEL
    group_size: int | None = None  # required for (and only for) GROUP

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        object.__setattr__(self, "granularity", Granularity(self.granularity))
        if (self.granularity is Granularity.GROUP) != (self.group_size is not None):
            raise ValueError("group_size is required for granularity 'group' and only for it")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1) - 1) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1


@dataclass(frozen=True)
class QParams:
    """Scale and zero point, shaped to broadcast against the grouped view of the tensor (see `grouped`)."""

    scale: torch.Tensor  # float32; [..., 1] per row, [N, G, 1] per group, [] per tensor
    zero: torch.Tensor | None  # float32 integer-valued zero points, same shape as scale; None when symmetric


def grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View of x in which each quantization unit is one last-dim row: [N, K] -> [N, K/g, g] for groups."""
    if spec.granularity is not Granularity.GROUP:
        return x
    k = x.shape[-1]
    if k % spec.group_size:
        raise ValueError(f"input dim {k} is not a multiple of group_size {spec.group_size}; pick a divisor of {k}")
    return x.reshape(*x.shape[:-1], k // spec.group_size, spec.group_size)


def _reduce(x: torch.Tensor, spec: QuantSpec, fn) -> torch.Tensor:
    if spec.granularity is Granularity.TENSOR:
        return fn(x.reshape(-1), dim=0)
    return fn(x, dim=-1, keepdim=True)


def compute_qparams(x: torch.Tensor, spec: QuantSpec) -> QParams:
    """Min/max (or absmax) quantization parameters of x [..., K] for `spec`."""
    xg = grouped(x.float(), spec)
    if spec.symmetric:
        absmax = _reduce(xg.abs(), spec, lambda t, **kw: t.amax(**kw))
        return QParams((absmax / spec.qmax).clamp_min(_EPS), None)
    lo = _reduce(xg, spec, lambda t, **kw: t.amin(**kw)).clamp_max(0)  # the grid always holds 0 exactly
    hi = _reduce(xg, spec, lambda t, **kw: t.amax(**kw)).clamp_min(0)
    return qparams_from_range(lo, hi, spec)


def shrink_qparams(
    x: torch.Tensor, spec: QuantSpec, max_shrink: float = 0.2, n_grid: int = 20, norm: float = 2.4
) -> QParams:
    """Like compute_qparams, but each unit's range [lo, hi] shrinks by the factor in 1, 1 - max_shrink / n_grid,
    ..., 1 - max_shrink that minimises sum |x - fake_quantize(x)|^norm over the unit: clipping a few
    outliers buys a finer grid for the rest (the `mse` grid of the GPTQ reference quantizer)."""
    xf = x.float()
    xg = grouped(xf, spec)
    lo = _reduce(xg, spec, lambda t, **kw: t.amin(**kw)).clamp_max(0)
    hi = _reduce(xg, spec, lambda t, **kw: t.amax(**kw)).clamp_min(0)

    def error(qp: QParams) -> torch.Tensor:  # per unit
        diff = grouped(fake_quantize(xf, spec, qp), spec) - xg
        return _reduce(diff.abs().pow(norm), spec, lambda t, **kw: t.sum(**kw))

    best = qparams_from_range(lo, hi, spec)
    best_err = error(best)
    for i in range(1, n_grid + 1):
        p = 1 - max_shrink * i / n_grid
        qp = qparams_from_range(p * lo, p * hi, spec)
        err = error(qp)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = QParams(
            torch.where(better, qp.scale, best.scale),
            None if qp.zero is None else torch.where(better, qp.zero, best.zero),
        )
    return best


def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> QParams:
    """Parameters mapping [lo, hi] onto the code range (asymmetric) or [-max|.|, max|.|] (symmetric)."""
    if spec.symmetric:
        return QParams((torch.maximum(lo.abs(), hi.abs()) / spec.qmax).clamp_min(_EPS), None)
    scale = ((hi - lo) / (spec.qmax - spec.qmin)).clamp_min(_EPS)
    zero = torch.clamp(torch.round(-lo / scale), spec.qmin, spec.qmax)
    return QParams(scale, zero)


def quantize(x: torch.Tensor, qp: QParams, spec: QuantSpec) -> torch.Tensor:
    """Integer codes (int8 tensor, the grouped view flattened back to x's shape)."""
    xg = grouped(x.float(), spec)
    q = torch.round(xg / qp.scale)
    if qp.zero is not None:
        q = q + qp.zero
    return (
        q.clamp_(spec.qmin, spec.qmax)
        .to(torch.int8 if spec.symmetric or spec.bits < 8 else torch.uint8)
        .reshape(x.shape)
    )


def dequantize(q: torch.Tensor, qp: QParams, spec: QuantSpec) -> torch.Tensor:
    """Float32 values of codes q (inverse of `quantize` up to rounding)."""
    qg = grouped(q.float(), spec)
    if qp.zero is not None:
        qg = qg - qp.zero
    return (qg * qp.scale).reshape(q.shape)


def fake_quantize(x: torch.Tensor, spec: QuantSpec, qp: QParams | None = None) -> torch.Tensor:
    """quantize then dequantize, in x's dtype: the values a quantized tensor stands for."""
    qp = qp or compute_qparams(x, spec)
    return dequantize(quantize(x, qp, spec), qp, spec).to(x.dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row of x [T, K] -> (codes int8 [T, K], scales float32 [T, 1])."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127).clamp_min(_EPS)
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return float("inf")
    return 10 * torch.log10(torch.tensor(signal / noise)).item()


# ---------------------------------------------------------------------------------------- 4-bit packing


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K] (K even) -> uint8 [..., K/2]: element 2i in the low nibble, 2i+1 in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even last dim, got {q.shape[-1]}")
    q = q.to(torch.int16)
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError("4-bit packing takes unsigned codes 0..15; offset symmetric codes first")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [..., K/2] -> uint8 codes [..., K]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ------------------------------------------------------------------------------------------------- FP8


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"unknown FP8 format {fmt!r}; use one of {', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[fmt]


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled FP8: x [R, K] -> (values in `dtype` [R, K], float32 scales [R, 1] or [] per tensor).

    The scale maps each row's (or the tensor's) absmax onto the format's largest finite value; values
    saturate instead of overflowing to inf/NaN.
    """
    finfo = torch.finfo(dtype)
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True) if per_row else xf.abs().amax()
    scale = (absmax / finfo.max).clamp_min(_EPS)
    return (xf / scale).clamp_(finfo.min, finfo.max).to(dtype), scale
