"""A bfloat16 linear layer for many rows (batched decode, mixed prefill+decode steps) on x86-64 CPUs with
AVX512-BF16, on weights packed once into the layout its micro-kernel reads (see gemm_bf16.c).

Built and loaded like cpu_gemv.py. `PackedBF16` is the packed weight; `should_use` says when it pays.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import call, loaded

_SOURCE = Path(__file__).with_name("gemm_bf16.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(source=_SOURCE, symbol="leanlm_gemm_bf16", argtypes=[_P] * 4 + [_I64] * 3 + [_INT], restype=_INT)
_QUANT_KERNEL = NativeKernel(
    source=_SOURCE, symbol="leanlm_gemm_quant", argtypes=[_P] * 6 + [_I64] * 4 + [_INT, _INT], restype=_INT
)
_PEAK = NativeKernel(
    source=_SOURCE, symbol="leanlm_bf16_dot_peak", argtypes=[_I64, _INT, ctypes.c_float], restype=ctypes.c_double
)
NR = 32  # output columns per packed panel
# Fewer rows go to the GEMV kernel (cpu_gemv), which reads W row-major once per 8 rows. No upper bound:
# on Zen 5 the kernel beat torch's bf16 GEMM (oneDNN) on the decoder shapes at every M tried, 9 to 4096.
MIN_ROWS = 9

_BF16 = torch.bfloat16


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16, a C compiler)."""
    return _KERNEL.is_available()


def quant_is_available() -> bool:
    """True when the weight-only int4 / int8 entry point (gemm_quant) is built and loaded."""
    return _QUANT_KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _KERNEL.unavailable_reason


@dataclass(frozen=True)
class PackedBF16:
    """W [N, K] bf16 (+ bias [N]) in the kernel's layout.

    data: [ceil(N / 32), Kp / 2, 32, 2] bf16, zero-padded (Kp = K rounded up to even).
    bias: [ceil(N / 32) * 32] float32, zero-padded, or None.
    """

    data: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def padded_in_features(self) -> int:
        return self.data.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (0 if self.bias is None else self.bias.numel() * 4)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedBF16:
    """Pack a bf16 weight [N, K] (and bias [N]) for gemm(); a copy: later changes to `weight` are not seen."""
    if weight.dim() != 2 or weight.dtype != _BF16:
        raise ValueError(f"pack takes a bf16 weight [N, K], not {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    Np, Kp = -(-N // NR) * NR, K + (K & 1)
    w = F.pad(weight.detach().cpu(), (0, Kp - K, 0, Np - N))  # [Np, Kp]
    data = w.view(Np // NR, NR, Kp // 2, 2).permute(0, 2, 1, 3).contiguous()  # [Np/32, Kp/2, 32, 2]
    return PackedBF16(data, _packed_bias(bias, N, Np), N, K)


def _rows_fit(x: torch.Tensor, packed: PackedBF16 | PackedQuant | None) -> bool:
    """Contiguous bf16 CPU rows x [M, K] with M >= MIN_ROWS for a packed weight of K inputs."""
    return (
        packed is not None
        and x.dtype is _BF16
        and x.is_cpu
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.shape[1] == packed.in_features
        and x.is_contiguous()
    )


def should_use(x: torch.Tensor, packed: PackedBF16 | None) -> bool:
    """Policy: route x @ W^T here when _rows_fit and the kernel is loaded."""
    return _rows_fit(x, packed) and is_available()


def _padded_rows(x: torch.Tensor, packed: PackedBF16 | PackedQuant) -> torch.Tensor:
    """x [M, K] checked and zero-padded to the packed weight's even Kp (the kernels read raw pointers)."""
    if not (x.dim() == 2 and x.dtype is _BF16 and x.is_cpu and x.shape[1] == packed.in_features):
        raise ValueError(f"x must be bf16 CPU rows [M, {packed.in_features}], not {x.dtype} {tuple(x.shape)}")
    Kp = packed.padded_in_features
    return F.pad(x, (0, Kp - x.shape[1])) if Kp != x.shape[1] else x.contiguous()


def gemm(x: torch.Tensor, packed: PackedBF16) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T + bias in bf16 (fp32 accumulation, one rounding), on torch.get_num_threads()."""
    fn = loaded(_KERNEL, "CPU bf16 GEMM kernel")
    x = _padded_rows(x, packed)
    M, N, Kp = x.shape[0], packed.out_features, x.shape[1]
    y = torch.empty(M, N, dtype=_BF16)
    call(fn, _KERNEL.symbol, x, packed.data, packed.bias, y, M, N, Kp, torch.get_num_threads())
    return y


@dataclass(frozen=True)
class PackedQuant:
    """A weight-only int4 (group-wise, w = q * scale + min) or int8 (per channel or per group, w = q * scale)
    weight in the kernel's panel order; widened to bf16 one panel at a time inside the kernel.

    codes: [ceil(N / 32), Kp / 2, 32] uint8 (int4: code i and i + 32 of a pair-row in one byte) or
           [ceil(N / 32), Kp / 2, 64] int8.
    scales, mins: [ceil(N / 32), Kp / group_size, 64] float32, each column's value twice (pair order).
    bias: as PackedBF16.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bias: torch.Tensor | None
    bits: int
    group_size: int
    out_features: int
    in_features: int

    @property
    def padded_in_features(self) -> int:
        return self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * 4
        return self.codes.numel() + (self.scales.numel() + self.mins.numel()) * 4 + extra


def _panel_order(t: torch.Tensor, Np: int, Kp: int) -> torch.Tensor:
    """[N, K] -> [Np / 32, Kp / 2, 64]: each pair-row's 32 columns x 2 in the bf16 panel's order."""
    t = F.pad(t, (0, Kp - t.shape[1], 0, Np - t.shape[0]))
    return t.view(Np // NR, NR, Kp // 2, 2).permute(0, 2, 1, 3).reshape(Np // NR, Kp // 2, 2 * NR)


def _group_order(t: torch.Tensor, Np: int) -> torch.Tensor:
    """[N, G] float -> [Np / 32, G, 64]: per panel and group, each column's value twice."""
    t = F.pad(t.float(), (0, 0, 0, Np - t.shape[0]))
    return t.view(Np // NR, NR, -1).permute(0, 2, 1).repeat_interleave(2, dim=-1).contiguous()


def _packed_bias(bias: torch.Tensor | None, N: int, Np: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (N,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({N},)")
    return F.pad(bias.detach().cpu().float(), (0, Np - N)).contiguous()


def pack_quant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bits: int,
    bias: torch.Tensor | None = None,
) -> PackedQuant:
    """Pack unpacked codes [N, K] (int4: uint8 0..15; int8: int8) with scales / mins [N, K / group_size]
    (mins None: zero) for gemm_quant(). group_size: even and dividing K, or (int8) K for per-channel scales."""
    if bits not in (4, 8) or codes.dim() != 2:
        raise ValueError(f"pack_quant takes 4- or 8-bit codes [N, K], not {bits} bits {tuple(codes.shape)}")
    N, K = codes.shape
    Np, Kp = -(-N // NR) * NR, K + (K & 1)
    if bits == 8 and group_size == K:
        group_size = Kp  # one group: per-channel scales, K padded with zero codes
    elif group_size <= 0 or group_size % 2 or K % group_size:
        raise ValueError(f"group_size {group_size} must be even and divide K={K}")
    if scales.shape != (N, Kp // group_size) or (mins is not None and mins.shape != scales.shape):
        raise ValueError(
            f"scales / mins {tuple(scales.shape)} do not match [N, K / group_size] = [{N}, {K // group_size}]"
        )
    ordered = _panel_order(codes.detach().cpu(), Np, Kp)  # [P, Kp/2, 64]
    if bits == 4:
        ordered = (ordered[..., :NR] | (ordered[..., NR:] << 4)).to(torch.uint8)  # [P, Kp/2, 32]
    mins = torch.zeros_like(scales, dtype=torch.float32) if mins is None else mins
    return PackedQuant(
        ordered.contiguous(),
        _group_order(scales.detach().cpu(), Np),
        _group_order(mins.detach().cpu(), Np),
        _packed_bias(bias, N, Np),
        bits,
        group_size,
        N,
        K,
    )


def gemm_quant(x: torch.Tensor, packed: PackedQuant) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantized(W)^T + bias in bf16: the weight widened to bf16 exactly as
    cpu_qgemv's dequantize kernels round it, then gemm()'s arithmetic."""
    fn = loaded(_QUANT_KERNEL, "CPU quantized GEMM kernel")
    x = _padded_rows(x, packed)
    M, N, Kp = x.shape[0], packed.out_features, x.shape[1]
    y = torch.empty(M, N, dtype=_BF16)
    tensors = (x, packed.codes, packed.scales, packed.mins, packed.bias, y)
    call(fn, _QUANT_KERNEL.symbol, *tensors, M, N, Kp, packed.group_size, packed.bits, torch.get_num_threads())
    return y


def measure_dot_peak(threads: int | None = None, seconds: float = 0.2) -> float:
    """The vdpbf16ps peak of `threads` cores in GFLOP/s, measured (register-only chains, best of 3 runs)."""
    fn = loaded(_PEAK, "CPU bf16 GEMM kernel")
    threads = threads or torch.get_num_threads()
    iters = 1 << 16
    while True:  # grow the run until it lasts long enough to time
        t = time.perf_counter()
        flop = fn(iters, threads, 1.0)
        dt = time.perf_counter() - t
        if dt >= seconds / 3:
            break
        iters *= 2
    best = flop / dt
    for _ in range(2):
        t = time.perf_counter()
        flop = fn(iters, threads, 1.0)
        best = max(best, flop / (time.perf_counter() - t))
    return best / 1e9


_BF16_CALL = call_entry(_SOURCE, "leanlm_gemm_bf16_call")
_QUANT_CALL = call_entry(_SOURCE, "leanlm_gemm_quant_call")


def native_call(packed: PackedBF16 | PackedQuant | None, out_features: int, in_features: int) -> NativeCall | None:
    """The decode loop's many-row call on a packed weight of this [N, K] with an even K (the loop passes its rows
    unpadded); None where there is none or it does not fit. Tensors: bf16 panels and bias, or code panels, scales,
    mins and bias with ints (group size, bits)."""
    if packed is None or (packed.out_features, packed.in_features, packed.padded_in_features) != (
        out_features,
        in_features,
        in_features,
    ):
        return None
    if isinstance(packed, PackedBF16):
        return NativeCall("gemm_bf16", _BF16_CALL, (packed.data, packed.bias), owner=packed)
    tensors = (packed.codes, packed.scales, packed.mins, packed.bias)
    return NativeCall("gemm_quant", _QUANT_CALL, tensors, (packed.group_size, packed.bits), owner=packed)
