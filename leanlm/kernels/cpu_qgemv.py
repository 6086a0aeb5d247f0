"""Weight-only int8 / int4 linear layers for a few rows (batch-1..64 decode) on x86-64 CPUs with AVX512-BF16,
and their dequantization to bf16 for many-row products.

Weights are widened to bf16 in registers and multiplied with the unchanged bf16 activations (fp32
accumulation), so results match float64 math on the dequantized weight to bf16 output rounding; see
gemv_quant.c. At M = 1 both kernels stream weights at about the bf16 kernel's rate; from M ~ 4 int4 is
bound by the same vdpbf16ps count as bf16, so it gains less there. Built and loaded like cpu_gemv.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, bias_fits, call_entry
from leanlm.kernels.spec import MIN_PARALLEL_BYTES

_SOURCE = Path(__file__).with_name("gemv_quant.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_INT8_KERNEL = NativeKernel(
    source=_SOURCE, symbol="leanlm_linear_int8", argtypes=[_P] * 5 + [_I64] * 4 + [_INT, _I64], restype=_INT
)
_INT4_KERNEL = NativeKernel(
    source=_SOURCE, symbol="leanlm_linear_int4", argtypes=[_P] * 6 + [_I64] * 4 + [_INT, _I64], restype=_INT
)
_DEQUANT_INT8 = NativeKernel(
    source=_SOURCE, symbol="leanlm_dequantize_int8", argtypes=[_P] * 3 + [_I64] * 3 + [_INT], restype=None
)
_DEQUANT_INT4 = NativeKernel(
    source=_SOURCE, symbol="leanlm_dequantize_int4", argtypes=[_P] * 4 + [_I64] * 3 + [_INT], restype=None
)
# should_use_*() accept up to this many rows of x. The kernels re-read the weight every 8 rows, yet up to
# about 64 rows that beats dequantizing the whole weight for a GEMM (1 thread, SmolLM2's 1536 x 576: int8
# 1.0 vs 1.6 ms at 64 rows, int4 1.4 vs 13 ms with torch's dequantization).
MAX_ROWS = 64

_BF16, _F32, _I8, _U8 = torch.bfloat16, torch.float32, torch.int8, torch.uint8


def is_available() -> bool:
    """True when the kernels are built and loaded (x86-64 Linux, AVX512-BF16, a C compiler)."""
    return _INT8_KERNEL.is_available() and _INT4_KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _INT8_KERNEL.unavailable_reason or _INT4_KERNEL.unavailable_reason


def _is_cpu_contiguous(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def _rows_ok(x: torch.Tensor, K: int) -> bool:
    return _is_cpu_contiguous(x, _BF16) and x.dim() >= 1 and x.shape[-1] == K and x.numel() <= MAX_ROWS * K


def should_use_int8(x: torch.Tensor, qweight: torch.Tensor, group_size: int | None = None) -> bool:
    """Policy: route an int8 linear here for contiguous CPU tensors with at most MAX_ROWS rows of bf16 x
    (per channel, or in groups of a multiple of 32 dividing K)."""
    if qweight.dim() != 2 or not _is_cpu_contiguous(qweight, _I8):
        return False
    return int8_group_ok(group_size, qweight.shape[1]) and _rows_ok(x, qweight.shape[1]) and is_available()


def int8_group_ok(group_size: int | None, K: int) -> bool:
    """None (per channel), 16 (GGUF Q6_K) or a positive multiple of 32, dividing K (then a multiple of 32):
    the group sizes the int8 kernel takes."""
    if group_size is None:
        return True
    return (
        type(group_size) is int
        and group_size > 0
        and (group_size % 32 == 0 or group_size == 16)
        and K % 32 == 0
        and K % group_size == 0
    )


def should_use_int4(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Policy: as should_use_int8, for packed int4 weights [N, K // 2] with a supported group_size."""
    if qweight.dim() != 2 or not _is_cpu_contiguous(qweight, _U8):
        return False
    K = 2 * qweight.shape[1]
    return (
        isinstance(group_size, int)
        and group_size > 0
        and group_size % 32 == 0
        and K % group_size == 0
        and _rows_ok(x, K)
        and is_available()
    )


def _check_common(x, qweight, qdtype, K, bias) -> None:
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D, not {tuple(qweight.shape)}")
    if not _is_cpu_contiguous(qweight, qdtype):
        raise ValueError(f"qweight must be a contiguous {qdtype} CPU tensor, not {qweight.dtype} on {qweight.device}")
    for name, t in (("x", x), ("bias", bias)):
        if t is not None and not _is_cpu_contiguous(t, _BF16):
            raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {t.dtype} on {t.device}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x {tuple(x.shape)} and qweight {tuple(qweight.shape)} do not match: want x [..., {K}]")
    if bias is not None and bias.shape != (qweight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({qweight.shape[0]},)")


def _check_float(name: str, t: torch.Tensor, shape: tuple) -> None:
    if not _is_cpu_contiguous(t, _F32):
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, not {t.dtype} on {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _fn(kernel: NativeKernel):
    fn = kernel.fn()
    if fn is None:
        raise RuntimeError(f"CPU quantized GEMV kernel unavailable: {kernel.unavailable_reason}")
    return fn


def linear_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ (qweight[N, K] * scales)^T + bias[N] -> bf16 [..., N], fp32 accumulation.

    x: contiguous bf16; qweight: contiguous int8 (symmetric); scales: float32 [N] per output channel
    (group_size None), or [N, K // group_size] per group of group_size input columns (16 or a multiple of
    32, dividing K: GGUF Q6_K, Q8_0 and Q5_0 blocks); bias: bf16 [N] or None; all on the CPU (checked: the C code
    reads raw pointers). Any number of rows works, but the weight is re-read every 8 rows. Runs on
    torch.get_num_threads() threads.
    """
    fn = _fn(_INT8_KERNEL)
    K = qweight.shape[1] if qweight.dim() == 2 else -1
    scale_shape = (
        (qweight.shape[0],)
        if group_size is None
        else (qweight.shape[0], K // group_size if int8_group_ok(group_size, K) else -1)
    )
    if not (
        qweight.dim() == 2
        and x.dtype is _BF16
        and qweight.dtype is _I8
        and scales.dtype is _F32
        and x.is_cpu
        and qweight.is_cpu
        and scales.is_cpu
        and x.is_contiguous()
        and qweight.is_contiguous()
        and scales.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == K
        and int8_group_ok(group_size, K)
        and scales.shape == scale_shape
        and (
            bias is None
            or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous() and bias.shape == qweight.shape[:1])
        )
    ):
        _check_common(x, qweight, _I8, K, bias)
        if not int8_group_ok(group_size, K):
            raise ValueError(
                f"group_size must be None, 16 or a multiple of 32, dividing K = {K} (itself a multiple of 32), "
                f"not {group_size!r}"
            )
        _check_float("scales", scales, scale_shape)
    N = qweight.shape[0]
    # (x.shape[0], N) for the usual 2-D x: building a torch.Size from x.shape[:-1] costs about a microsecond
    y = torch.empty((x.shape[0], N) if x.dim() == 2 else x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:  # an empty sum: the bias alone
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(
        x.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        N,
        K,
        K if group_size is None else group_size,
        torch.get_num_threads(),
        MIN_PARALLEL_BYTES,
    )
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_int8 failed (code {rc})")
    return y


def linear_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ w^T + bias -> bf16 [..., N] for group-quantized 4-bit (or fewer-bit) codes.

    qweight: uint8 [N, K // 2]; weight (n, k) is the code q in 0..15 in byte k // 2 of row n, low nibble
    for even k, high nibble for odd k. scales, mins: float32 [N, K // group_size];
    w[n, k] = q * scales[n, g] + mins[n, g] with g = k // group_size (asymmetric zero points: mins =
    -zero * scale). group_size: a multiple of 32 dividing K. x, bias: bf16 as in linear_int8.
    """
    fn = _fn(_INT4_KERNEL)
    if not (
        qweight.dim() == 2
        and x.dtype is _BF16
        and qweight.dtype is _U8
        and scales.dtype is _F32
        and mins.dtype is _F32
        and x.is_cpu
        and qweight.is_cpu
        and scales.is_cpu
        and mins.is_cpu
        and x.is_contiguous()
        and qweight.is_contiguous()
        and scales.is_contiguous()
        and mins.is_contiguous()
        and type(group_size) is int
        and group_size > 0
        and group_size % 32 == 0
        and x.dim() >= 1
        and x.shape[-1] == 2 * qweight.shape[1]
        and x.shape[-1] % group_size == 0
        and scales.dim() == 2
        and scales.shape[0] == qweight.shape[0]
        and scales.shape[1] * group_size == x.shape[-1]
        and mins.shape == scales.shape
        and (
            bias is None
            or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous() and bias.shape == qweight.shape[:1])
        )
    ):
        K = 2 * qweight.shape[1] if qweight.dim() == 2 else -1
        _check_common(x, qweight, _U8, K, bias)
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 32 != 0 or K % group_size != 0:
            raise ValueError(
                f"group_size must be an int, a positive multiple of 32 that divides K = {K}, not {group_size!r}"
            )
        _check_float("scales", scales, (qweight.shape[0], K // group_size))
        _check_float("mins", mins, (qweight.shape[0], K // group_size))
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    # (x.shape[0], N) for the usual 2-D x: building a torch.Size from x.shape[:-1] costs about a microsecond
    y = torch.empty((x.shape[0], N) if x.dim() == 2 else x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(
        x.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        N,
        K,
        group_size,
        torch.get_num_threads(),
        MIN_PARALLEL_BYTES,
    )
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_int4 failed (code {rc})")
    return y


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """bf16 [N, K] = qweight [N, K] int8 * scales ([N], or [N, K / group_size] per group) (fp32 product, one
    rounding), on all threads."""
    if qweight.dim() != 2 or not _is_cpu_contiguous(qweight, _I8):
        raise ValueError(
            f"qweight must be a contiguous 2-D int8 CPU tensor, not {qweight.dtype} {tuple(qweight.shape)}"
        )
    N, K = qweight.shape
    if not int8_group_ok(group_size, K):
        raise ValueError(
            f"group_size must be None, 16 or a multiple of 32, dividing K = {K} (itself a multiple of 32), "
            f"not {group_size!r}"
        )
    _check_float("scales", scales, (N,) if group_size is None else (N, K // group_size))
    out = torch.empty(qweight.shape, dtype=_BF16)
    gs = K if group_size is None else group_size
    _fn(_DEQUANT_INT8)(qweight.data_ptr(), scales.data_ptr(), out.data_ptr(), N, K, gs, torch.get_num_threads())
    return out


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [N, K] = q * scales + mins per group (fp32 product then sum, one rounding) from packed codes
    [N, K / 2] (low nibble first); the stored column order (no act-order permutation)."""
    if qweight.dim() != 2 or not _is_cpu_contiguous(qweight, _U8):
        raise ValueError(
            f"qweight must be a contiguous 2-D uint8 CPU tensor, not {qweight.dtype} {tuple(qweight.shape)}"
        )
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size:
        raise ValueError(f"group_size must be a positive int dividing K = {K}, not {group_size!r}")
    _check_float("scales", scales, (N, K // group_size))
    _check_float("mins", mins, (N, K // group_size))
    out = torch.empty(N, K, dtype=_BF16)
    _fn(_DEQUANT_INT4)(
        qweight.data_ptr(),
        scales.data_ptr(),
        mins.data_ptr(),
        out.data_ptr(),
        N,
        K,
        group_size,
        torch.get_num_threads(),
    )
    return out


_INT8_CALL = call_entry(_SOURCE, "leanlm_linear_int8_call")
_INT4_CALL = call_entry(_SOURCE, "leanlm_linear_int4_call")


def int8_native_call(
    qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int | None
) -> NativeCall | None:
    """The decode loop's call of the int8 GEMV: codes int8 [N, K], scales float32 [N] (group_size None) or
    [N, K / group_size], bias bf16 [N] or None; None where the tensors are not what it reads."""
    if qweight.dim() != 2 or qweight.dtype != _I8 or not int8_group_ok(group_size, qweight.shape[1]):
        return None
    N, K = qweight.shape
    shape = (N,) if group_size is None else (N, K // group_size)
    if scales.dtype != torch.float32 or tuple(scales.shape) != shape or not bias_fits(bias, N):
        return None
    return NativeCall("int8", _INT8_CALL, (qweight, scales, bias), (group_size or K,))


def int4_native_call(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> NativeCall | None:
    """The decode loop's call of the 2-4 bit GEMV: codes uint8 [N, K / 2], scales and mins float32
    [N, K / group_size] (group_size a multiple of 32), bias bf16 [N] or None; None where they do not fit."""
    if qweight.dim() != 2 or qweight.dtype != _U8:
        return None
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    if not (isinstance(group_size, int) and group_size > 0 and group_size % 32 == 0 and K % group_size == 0):
        return None
    side_ok = all(t.dtype == torch.float32 and tuple(t.shape) == (N, K // group_size) for t in (scales, mins))
    if not (side_ok and bias_fits(bias, N)):
        return None
    return NativeCall("int4", _INT4_CALL, (qweight, scales, mins, bias), (group_size,))
