"""A 2:4 semi-structured sparse bfloat16 linear layer for a few rows (batch-1..8 decode) on x86-64 CPUs with
AVX512-BF16 and AVX512-VBMI2 (Ice Lake and later, Zen 4 and later; not Cooper Lake, which has BF16 only).

The weight stays in Sparse24Linear's saved layout (kept values [N, K / 2] + a 4-bit-per-group mask [N, K / 8]);
gemv_sparse24.c widens it in registers, so it reads 56% of the dense weight's bytes, and its results equal
cpu_gemv.linear_bf16 on the dense weight bit for bit. Built and loaded like cpu_gemv.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, bias_fits, call_entry
from leanlm.kernels.spec import MIN_PARALLEL_BYTES

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemv_sparse24.c"),
    symbol="leanlm_linear_sparse24",
    argtypes=[_P] * 5 + [_I64] * 3 + [_INT, _I64],
    restype=_INT,
    cpu_needs=("avx512_bf16", "avx512_vbmi2"),
)
MAX_ROWS = 8  # should_use() accepts up to this many rows of x (one pass over W); 9+ rows go to cpu_gemm

_BF16, _U8 = torch.bfloat16, torch.uint8


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16 and VBMI2, a C compiler)."""
    return _KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _KERNEL.unavailable_reason


def _is_cpu_contiguous(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous()


def should_use(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    """Policy: route a 2:4 linear here for contiguous CPU tensors, bf16 x and values, at most MAX_ROWS rows."""
    return (
        values.dim() == 2
        and _is_cpu_contiguous(values, _BF16)
        and _is_cpu_contiguous(mask, _U8)
        and _is_cpu_contiguous(x, _BF16)
        and x.dim() >= 1
        and x.shape[-1] == 2 * values.shape[1]
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and is_available()
    )


def _check_args(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The slow path of linear_sparse24's argument check: say what is wrong."""
    if values.dim() != 2 or mask.dim() != 2:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must be 2-D: [N, K/2], [N, K/8]")
    N, K = values.shape[0], 2 * values.shape[1]
    if K % 8 or mask.shape != (N, K // 8):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; values {tuple(values.shape)} need [{N}, K/8] with 8 | K")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x {tuple(x.shape)} does not match values {tuple(values.shape)}: want x [..., {K}]")
    if not _is_cpu_contiguous(mask, _U8):
        raise ValueError(f"mask must be a contiguous uint8 CPU tensor, not {mask.dtype} on {mask.device}")
    for name, t in (("x", x), ("values", values), ("bias", bias)):
        if t is not None and not _is_cpu_contiguous(t, _BF16):
            raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {t.dtype} on {t.device}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({N},)")


def linear_sparse24(
    x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T + bias -> bf16 [..., N], W 2:4 sparse: values bf16 [N, K / 2], mask uint8 [N, K / 8]
    (Sparse24Linear's layout; every nibble of mask must hold exactly 2 set bits, which the layer checks on
    construction: the kernel trusts it). fp32 accumulation, one rounding. Any number of rows works, but W is
    re-read every MAX_ROWS rows. Runs on torch.get_num_threads() threads."""
    fn = _KERNEL.fn()
    if fn is None:
        raise RuntimeError(f"CPU 2:4 sparse GEMV kernel unavailable: {_KERNEL.unavailable_reason}")
    # The fast check (one expression: this runs ~200 times per decoded token); _check_args explains.
    if not (
        values.dim() == 2
        and x.dim() >= 1
        and x.dtype is _BF16
        and values.dtype is _BF16
        and mask.dtype is _U8
        and x.is_cpu
        and values.is_cpu
        and mask.is_cpu
        and x.is_contiguous()
        and values.is_contiguous()
        and mask.is_contiguous()
        and x.shape[-1] == 2 * values.shape[1]
        and x.shape[-1] % 8 == 0
        and mask.shape == (values.shape[0], x.shape[-1] // 8)
        and (
            bias is None
            or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous() and bias.shape == values.shape[:1])
        )
    ):
        _check_args(x, values, mask, bias)
    N, K = values.shape[0], x.shape[-1]
    y = torch.empty((x.shape[0], N) if x.dim() == 2 else x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:  # an empty sum: the bias alone
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(
        x.data_ptr(),
        values.data_ptr(),
        mask.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        N,
        K,
        torch.get_num_threads(),
        MIN_PARALLEL_BYTES,
    )
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_sparse24 failed (code {rc})")
    return y


# ---------------------------------------------------------------------------------- int8 / int4 2:4 codes

_QUANT_SOURCE = Path(__file__).with_name("gemv_sparse24_quant.c")
_INT8_KERNEL = NativeKernel(
    source=_QUANT_SOURCE,
    symbol="leanlm_linear_sparse24_int8",
    argtypes=[_P] * 6 + [_I64] * 4 + [_INT, _I64],
    restype=_INT,
    cpu_needs=("avx512_bf16", "avx512_vbmi2"),
)
_INT4_KERNEL = NativeKernel(
    source=_QUANT_SOURCE,
    symbol="leanlm_linear_sparse24_int4",
    argtypes=[_P] * 7 + [_I64] * 4 + [_INT, _I64],
    restype=_INT,
    cpu_needs=("avx512_bf16", "avx512_vbmi2"),
)
CHUNK = 64  # dense input columns per kernel step: K and the group size must be multiples of it
_I8 = torch.int8


def quant_is_available() -> bool:
    """True when the int8 and int4 2:4 kernels are built and loaded (as is_available)."""
    return _INT8_KERNEL.is_available() and _INT4_KERNEL.is_available()


def quant_group_ok(group_size: int, K: int) -> bool:
    """The quantized 2:4 kernels' shapes: K a multiple of 64, and groups of a multiple of 64 dividing K (K itself
    for one scale per row)."""
    return K > 0 and K % CHUNK == 0 and group_size > 0 and group_size % CHUNK == 0 and K % group_size == 0


def should_use_quant(x: torch.Tensor, codes: torch.Tensor, bits: int, group_size: int) -> bool:
    """Policy: route a quantized 2:4 linear here for contiguous bf16 CPU x of at most MAX_ROWS rows."""
    if codes.dim() != 2 or not _is_cpu_contiguous(codes, _I8 if bits == 8 else _U8):
        return False
    K = codes.shape[1] * (2 if bits == 8 else 4)
    return (
        quant_group_ok(group_size, K)
        and _is_cpu_contiguous(x, _BF16)
        and x.dim() >= 1
        and x.shape[-1] == K
        and x.numel() <= MAX_ROWS * K
        and quant_is_available()
    )


def _check_quant_args(x, codes, mask, scales, zeros, bias, bits: int, group_size: int) -> int:
    """Say what is wrong with linear_sparse24_quant's arguments, or return K."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D, not {tuple(codes.shape)}")
    N, K = codes.shape[0], codes.shape[1] * (2 if bits == 8 else 4)
    if not quant_group_ok(group_size, K):
        raise ValueError(f"K={K} and group_size={group_size} must be multiples of {CHUNK}, the group dividing K")
    want = {"codes": (codes, _I8 if bits == 8 else _U8, None), "mask": (mask, _U8, (N, K // 8))}
    want["scales"] = (scales, torch.float32, (N, K // group_size))
    if bits == 4:
        want["zeros"] = (zeros, _U8, (N, K // group_size))
    want["x"] = (x, _BF16, None)
    if bias is not None:
        want["bias"] = (bias, _BF16, (N,))
    for name, (t, dtype, shape) in want.items():
        if t is None or not _is_cpu_contiguous(t, dtype) or (shape is not None and tuple(t.shape) != shape):
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
            raise ValueError(
                f"{name} must be a contiguous {dtype} CPU tensor{'' if shape is None else f' {shape}'}, not {got}"
            )
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x {tuple(x.shape)} does not match codes {tuple(codes.shape)}: want x [..., {K}]")
    return K


def linear_sparse24_quant(
    x: torch.Tensor,
    codes: torch.Tensor,
    mask: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [..., K] @ W^T + bias -> bf16 [..., N], W 2:4 sparse with quantized kept weights (gemv_sparse24_quant.c's
    layouts): bits 8: codes int8 [N, K / 2], w = q * scale; bits 4: codes uint8 [N, K / 4] in 64-column chunks,
    w = q * scale - zero * scale. mask uint8 [N, K / 8] with exactly 2 bits per nibble (the layer checks it: the
    kernel trusts it); scales float32 [N, K / group_size]; zeros uint8 of that shape (int4 only)."""
    kernel = _INT8_KERNEL if bits == 8 else _INT4_KERNEL
    fn = kernel.fn()
    if fn is None:
        raise RuntimeError(f"CPU quantized 2:4 GEMV kernel unavailable: {kernel.unavailable_reason}")
    # The fast check (one expression: this runs ~200 times per decoded token); _check_quant_args explains.
    N, K = codes.shape[0], codes.shape[-1] * (2 if bits == 8 else 4)
    if not (
        codes.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == K
        and x.dtype is _BF16
        and codes.dtype is (_I8 if bits == 8 else _U8)
        and mask.dtype is _U8
        and scales.dtype is torch.float32
        and all(t.is_cpu and t.is_contiguous() for t in (x, codes, mask, scales))
        and mask.shape == (N, K // 8)
        and quant_group_ok(group_size, K)
        and scales.shape == (N, K // group_size)
        and (
            bits == 8
            or (
                zeros is not None
                and zeros.dtype is _U8
                and zeros.shape == scales.shape
                and zeros.is_cpu
                and zeros.is_contiguous()
            )
        )
        and (bias is None or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous() and bias.shape == (N,)))
    ):
        _check_quant_args(x, codes, mask, scales, zeros, bias, bits, group_size)
    y = torch.empty(x.shape[:-1] + (N,), dtype=_BF16)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    args = [ptr(x), ptr(codes), ptr(mask), ptr(scales)] + ([ptr(zeros)] if bits == 4 else []) + [ptr(bias), ptr(y)]
    rc = fn(*args, x.numel() // K, N, K, group_size, torch.get_num_threads(), MIN_PARALLEL_BYTES)
    if rc != 0:
        raise RuntimeError(f"{kernel.symbol} failed (code {rc})")
    return y


_CALL = call_entry(_KERNEL.source, "leanlm_linear_sparse24_call", _KERNEL.cpu_needs)
_INT8_CALL = call_entry(_QUANT_SOURCE, "leanlm_linear_sparse24_int8_call", _INT8_KERNEL.cpu_needs)
_INT4_CALL = call_entry(_QUANT_SOURCE, "leanlm_linear_sparse24_int4_call", _INT4_KERNEL.cpu_needs)


def _mask_fits(mask: torch.Tensor | None, n: int, k: int) -> bool:
    return mask is not None and mask.dtype == _U8 and tuple(mask.shape) == (n, k // 8)


def native_call(values: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> NativeCall | None:
    """The decode loop's call of the 2:4 GEMV: values bf16 [N, K / 2], mask uint8 [N, K / 8], bias bf16 [N] or
    None; None where they do not fit."""
    if values.dim() != 2 or values.dtype != _BF16:
        return None
    N, K = values.shape[0], 2 * values.shape[1]
    if not (_mask_fits(mask, N, K) and bias_fits(bias, N)):
        return None
    return NativeCall("sparse24", _CALL, (values, mask, bias))


def quant_native_call(
    codes: torch.Tensor,
    mask: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> NativeCall | None:
    """The decode loop's call of the quantized 2:4 GEMV: int8 codes [N, K / 2] (bits 8, zeros None) or 4-bit codes
    uint8 [N, K / 4] with zeros uint8 [N, K / group_size]; mask, scales float32 [N, K / group_size] (group_size K:
    one per row), bias bf16 [N] or None; None where they do not fit."""
    int4 = bits == 4
    if codes.dim() != 2 or codes.dtype != (_U8 if int4 else _I8) or (zeros is None) == int4:
        return None
    N, K = codes.shape[0], codes.shape[1] * (4 if int4 else 2)
    if not (quant_group_ok(group_size, K) and _mask_fits(mask, N, K) and bias_fits(bias, N)):
        return None
    side = [(scales, torch.float32)] + ([(zeros, _U8)] if int4 else [])
    if not all(t.dtype == dtype and tuple(t.shape) == (N, K // group_size) for t, dtype in side):
        return None
    if int4:
        return NativeCall("sparse24_int4", _INT4_CALL, (codes, mask, scales, zeros, bias), (group_size,))
    return NativeCall("sparse24_int8", _INT8_CALL, (codes, mask, scales, bias), (group_size,))
