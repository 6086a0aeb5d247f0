"""The W8A8 linear layer (int8 weights per channel, int8 activations per token) on x86-64 CPUs with
AVX512-VNNI, on weights packed once into the layout vpdpbusd reads (see gemm_w8a8.c). Any number of rows:
at one row it streams one byte per weight, from a dozen rows on it runs at about twice the bf16 GEMM's
arithmetic rate.

Built and loaded like cpu_gemm.py. The result equals the torch reference (`int8_matmul`) bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import call, loaded

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemm_w8a8.c"),
    symbol="leanlm_gemm_w8a8",
    argtypes=[_P] * 5 + [_I64] * 3 + [_INT],
    restype=_INT,
    cpu_needs=("avx512_bf16", "avx512_vnni"),
)
NR = 32  # output columns per packed panel
MAX_K = 65535  # int32 sums of 4-byte products stay exact below this many inputs


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16 and -VNNI, a C compiler)."""
    return _KERNEL.is_available()


@dataclass(frozen=True)
class PackedW8A8:
    """Int8 codes [N, K] with per-channel scales (+ bias) in the kernel's layout.

    data: [ceil(N / 32), Kq / 4, 32, 4] uint8, each code + 128 (Kq = K rounded up to a multiple of 4; padding
          holds code 0).
    scales, bias: [ceil(N / 32) * 32] float32, zero-padded; bias may be None.
    """

    data: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * 4
        return self.data.numel() + self.scales.numel() * 4 + extra


def pack(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> PackedW8A8:
    """Pack int8 codes [N, K] with scales [N] (and bias [N]) for gemm(); a copy."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8 or not 0 < qweight.shape[1] <= MAX_K:
        raise ValueError(f"pack takes int8 codes [N, K] with 0 < K <= {MAX_K}, not {qweight.dtype} {qweight.shape}")
    N, K = qweight.shape
    if scales.numel() != N or (bias is not None and bias.numel() != N):
        raise ValueError(f"scales and bias need {N} values (one per output column)")
    Np, Kq = -(-N // NR) * NR, -(-K // 4) * 4
    u = F.pad(qweight.detach().cpu().to(torch.int16), (0, Kq - K, 0, Np - N)) + 128  # [Np, Kq]: 0..255
    data = u.to(torch.uint8).view(Np // NR, NR, Kq // 4, 4).permute(0, 2, 1, 3).contiguous()
    pad = lambda t: F.pad(t.detach().cpu().float().reshape(N), (0, Np - N)).contiguous()  # noqa: E731
    return PackedW8A8(data, pad(scales), None if bias is None else pad(bias), N, K)


def rows_fit(x: torch.Tensor, packed: PackedW8A8 | None) -> bool:
    """Contiguous bf16 CPU rows x [M, K] for a packed weight of K inputs, and the kernel loaded."""
    return (
        packed is not None
        and x.dtype is torch.bfloat16
        and x.is_cpu
        and x.dim() == 2
        and x.shape[1] == packed.in_features
        and x.is_contiguous()
        and is_available()
    )


def gemm(x: torch.Tensor, packed: PackedW8A8) -> torch.Tensor:
    """y [M, N] bf16 = the int8 product of x [M, K] bf16 quantized per row (quantize_per_token_int8) and the
    codes, * s_x * s_w + bias, in float32 and rounded once: int8_matmul's result, on torch.get_num_threads()."""
    fn = loaded(_KERNEL, "CPU W8A8 kernel")
    if not (x.dim() == 2 and x.dtype is torch.bfloat16 and x.is_cpu and x.shape[1] == packed.in_features):
        raise ValueError(f"x must be bf16 CPU rows [M, {packed.in_features}], not {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    M, N, K = x.shape[0], packed.out_features, packed.in_features
    y = torch.empty(M, N, dtype=torch.bfloat16)
    call(fn, _KERNEL.symbol, x, packed.data, packed.scales, packed.bias, y, M, N, K, torch.get_num_threads())
    return y


_CALL = call_entry(_KERNEL.source, "leanlm_gemm_w8a8_call", _KERNEL.cpu_needs)


def native_call(packed: PackedW8A8 | None, out_features: int, in_features: int) -> NativeCall | None:
    """The decode loop's call of this kernel (at every row count) on a packed weight of this [N, K]: tensors the
    panels, their scales and the float32 bias; None where there is none or it does not fit."""
    if packed is None or (packed.out_features, packed.in_features) != (out_features, in_features):
        return None
    return NativeCall("w8a8", _CALL, (packed.data, packed.scales, packed.bias), owner=packed)
