"""Dynamic int8 activations for int4 and int8 weight-only layers (W4A8 / W8A8-dynamic) on x86-64 CPUs with
AVX512-VNNI (gemm_a8.c): each row of x is quantized to int8 in groups of 32 inputs on the fly, and the product
runs as int8 x int4/int8 dot products (vpdpbusd), with the weights' group scales (and int4 mins) applied per group.

The result is `reference`'s (fake-quantized x times the dequantized weight) up to float32 summation order: the
kernel adds group by group, the reference in one matmul. Both paths of a layer (per-layer and the native decode
loop) call this kernel, so they agree bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm.kernels.act_int8 import ACT_GROUP, fake_quantize_act_int8
from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import call, loaded

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemm_a8.c"),
    symbol="leanlm_gemm_a8",
    argtypes=[_P] * 6 + [_I64] * 3 + [_INT, _I64, _INT],
    restype=_INT,
    cpu_needs=("avx512_bf16", "avx512_vnni"),
)
_CALL = call_entry(_KERNEL.source, "leanlm_gemm_a8_call", _KERNEL.cpu_needs)
NR = 32  # output columns per packed panel
MAX_K = 65535  # int32 group sums stay exact far beyond; the kernel's sizes are int64 below this


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16 and -VNNI, a C compiler)."""
    return _KERNEL.is_available()


def shape_ok(in_features: int, group_size: int | None) -> bool:
    """K whole activation groups, and weight groups (None: per channel) made of whole activation groups."""
    k_ok = 0 < in_features <= MAX_K and in_features % ACT_GROUP == 0
    return k_ok and (group_size is None or group_size % ACT_GROUP == 0)


@dataclass(frozen=True)
class PackedA8:
    """Int4 or int8 codes [N, K] in the kernel's panels (gemm_a8.c), with their scales (int4: and mins).

    data: int8 [ceil(N / 32), K / 4, 32, 4] uint8 codes + 128; int4 [ceil(N / 32), K / 8, 2, 64] nibble pairs.
    scales, mins: [ceil(N / 32), K / (32 span), 32] float32, one row per weight group of `span` activation groups
    (per channel: one row, span K / 32); mins None for int8. bias: [ceil(N / 32) * 32] float32 or None.
    """

    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None
    bits: int
    span: int  # activation groups of 32 per weight scale
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        tensors = (self.data, self.scales, self.mins, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _span(K: int, group_size: int | None) -> int:
    """Activation groups per weight scale."""
    return (K if group_size is None else group_size) // ACT_GROUP


def _panel_scales(t: torch.Tensor, N: int) -> torch.Tensor:
    """[N] (per channel) or [N, S] -> [ceil(N / 32), S, 32] float32: each panel's 32 columns side by side."""
    t = t.detach().cpu().float().reshape(N, -1)
    Np = -(-N // NR) * NR
    return F.pad(t, (0, 0, 0, Np - N)).view(Np // NR, NR, t.shape[1]).transpose(1, 2).contiguous()


def _bias(bias: torch.Tensor | None, N: int) -> torch.Tensor | None:
    if bias is None:
        return None
    return F.pad(bias.detach().cpu().float().reshape(N), (0, -(-N // NR) * NR - N)).contiguous()


def _check(codes: torch.Tensor, group_size: int | None) -> tuple[int, int]:
    if codes.dim() != 2 or not shape_ok(codes.shape[1], group_size):
        raise ValueError(
            f"gemm_a8 takes codes [N, K] with K a multiple of {ACT_GROUP} (at most {MAX_K}) and weight groups of a "
            f"multiple of {ACT_GROUP} (or per channel), not {tuple(codes.shape)} with group_size {group_size}"
        )
    return codes.shape[0], codes.shape[1]


def pack_int8(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None, bias: torch.Tensor | None = None
) -> PackedA8:
    """Signed int8 codes [N, K] with scales [N] (group_size None) or [N, K / group_size]; a copy."""
    N, K = _check(qweight, group_size)
    Np = -(-N // NR) * NR
    u = (F.pad(qweight.detach().cpu().to(torch.int16), (0, 0, 0, Np - N)) + 128).to(torch.uint8)  # [Np, K]
    data = u.view(Np // NR, NR, K // 4, 4).permute(0, 2, 1, 3).contiguous()
    return PackedA8(data, _panel_scales(scales, N), None, _bias(bias, N), 8, _span(K, group_size), N, K)


def pack_int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> PackedA8:
    """Unsigned 4-bit codes [N, K] (0..15, one per byte: numerics.unpack_int4) with w = q * scale + min per group
    of `group_size` inputs; a copy."""
    N, K = _check(codes, group_size)
    Np = -(-N // NR) * NR
    q = F.pad(codes.detach().cpu().to(torch.uint8), (0, 0, 0, Np - N))  # [Np, K]
    q = q.view(Np // NR, 2, 16, K // 8, 2, 4)  # [panel, half, column, quad pair j, quad 2j or 2j+1, t]
    nibbles = q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)  # [panel, half, column, j, t]
    data = nibbles.permute(0, 3, 1, 2, 4).contiguous()  # [panel, j, half, column, t]: 128 bytes per quad pair
    return PackedA8(
        data,
        _panel_scales(scales, N),
        _panel_scales(mins, N),
        _bias(bias, N),
        4,
        _span(K, group_size),
        N,
        K,
    )


def rows_fit(x: torch.Tensor, packed: PackedA8 | None) -> bool:
    """bf16 CPU rows x [..., K] for a packed weight of K inputs, no gradient asked for, and the kernel loaded."""
    return (
        packed is not None
        and x.dtype is torch.bfloat16
        and x.is_cpu
        and x.shape[-1] == packed.in_features
        and not (x.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
        and is_available()
    )


def gemm(x: torch.Tensor, packed: PackedA8) -> torch.Tensor:
    """y [..., N] bf16 = quantize_act_int8(x) times the packed weight (+ bias), on torch.get_num_threads()."""
    fn = loaded(_KERNEL, "CPU W4A8 / W8A8-dynamic kernel")
    if not (x.dtype is torch.bfloat16 and x.is_cpu and x.shape[-1] == packed.in_features):
        raise ValueError(f"x must be bf16 CPU rows [..., {packed.in_features}], not {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, packed.in_features).contiguous()
    M, N, K = x2.shape[0], packed.out_features, packed.in_features
    y = torch.empty(M, N, dtype=torch.bfloat16)
    args = (x2, packed.data, packed.scales, packed.mins, packed.bias, y, M, N, K, packed.bits, packed.span)
    call(fn, _KERNEL.symbol, *args, torch.get_num_threads())
    return y.reshape(*x.shape[:-1], N)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float32 torch ops on any device: fake-quantized x [..., K] times the
    dequantized weight [N, K] (+ bias), in x's dtype."""
    y = F.linear(fake_quantize_act_int8(x), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def native_call(packed: PackedA8 | None, out_features: int, in_features: int) -> NativeCall | None:
    """The decode loop's call of this kernel (at every row count): tensors the panels, scales, mins (or None) and
    float32 bias, ints the weight bits and the span; None where there is no packed weight of this [N, K]."""
    if packed is None or (packed.out_features, packed.in_features) != (out_features, in_features):
        return None
    tensors = (packed.data, packed.scales, packed.mins, packed.bias)
    return NativeCall("a8", _CALL, tensors, (packed.bits, packed.span), owner=packed)
