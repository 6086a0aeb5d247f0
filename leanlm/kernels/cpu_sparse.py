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
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec, Rule

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


_X, _BIAS = Arg("x", _BF16, (ROWS, "K")), Arg("bias", _BF16, ("N",), optional=True)
# kept values [N, K / 2] and a 4-bit-per-group mask [N, K / 8]
SPEC = KernelSpec(
    _KERNEL,
    "CPU 2:4 sparse GEMV kernel",
    [_X, Arg("values", _BF16, ("N", "K/2")), Arg("mask", _U8, ("N", "K/8")), _BIAS],
)


def should_use(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
    """Policy: route a 2:4 linear here for contiguous CPU tensors, bf16 x and values, at most MAX_ROWS rows."""
    return SPEC.rows_fit(x, values, mask, None, max_rows=MAX_ROWS) and is_available()


def linear_sparse24(
    x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T + bias -> bf16 [..., N], W 2:4 sparse: values bf16 [N, K / 2], mask uint8 [N, K / 8]
    (Sparse24Linear's layout; every nibble of mask must hold exactly 2 set bits, which the layer checks on
    construction: the kernel trusts it). fp32 accumulation, one rounding. Any number of rows works, but W is
    re-read every MAX_ROWS rows. Runs on torch.get_num_threads() threads."""
    if not SPEC.fits(x, values, mask, bias):
        SPEC.explain(x, values, mask, bias)
    N, K = values.shape[0], 2 * values.shape[1]
    return SPEC.linear(x, N, K, (x, values, mask, bias), bias=bias)


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
    return (
        K > 0
        and K % CHUNK == 0
        and type(group_size) is int
        and group_size > 0
        and group_size % CHUNK == 0
        and K % group_size == 0
    )


_QUANT_RULE = Rule(("G", "K"), quant_group_ok, "K={K} and group_size={G} must be multiples of 64, the group dividing K")
_MASK, _SCALES = Arg("mask", _U8, ("N", "K/8")), Arg("scales", torch.float32, ("N", "K/G"))
# bits 8: int8 codes [N, K / 2]; bits 4: codes uint8 [N, K / 4] and zero points [N, K / G]
QUANT_SPECS = {
    8: KernelSpec(
        _INT8_KERNEL,
        "CPU int8 2:4 GEMV kernel",
        [_X, Arg("codes", _I8, ("N", "K/2")), _MASK, _SCALES, _BIAS],
        given=("G",),
        rules=(_QUANT_RULE,),
    ),
    4: KernelSpec(
        _INT4_KERNEL,
        "CPU int4 2:4 GEMV kernel",
        [_X, Arg("codes", _U8, ("N", "K/4")), _MASK, _SCALES, Arg("zeros", _U8, ("N", "K/G")), _BIAS],
        given=("G",),
        rules=(_QUANT_RULE,),
    ),
}


def _quant_args(x, codes, mask, scales, zeros, bias, bits: int) -> tuple:
    return (x, codes, mask, scales, bias) if bits == 8 else (x, codes, mask, scales, zeros, bias)


def should_use_quant(x: torch.Tensor, codes: torch.Tensor, bits: int, group_size: int) -> bool:
    """Policy: route a quantized 2:4 linear here for contiguous bf16 CPU x of at most MAX_ROWS rows."""
    spec = QUANT_SPECS.get(bits)
    absent = (None,) * (len(spec.args) - 2) if spec is not None else ()
    return spec is not None and spec.rows_fit(x, codes, *absent, group_size, max_rows=MAX_ROWS) and quant_is_available()


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
    spec, args = QUANT_SPECS[bits], _quant_args(x, codes, mask, scales, zeros, bias, bits)
    if not spec.fits(*args, group_size):
        spec.explain(*args, group_size)
    N, K = codes.shape[0], x.shape[-1]
    return spec.linear(x, N, K, args, (group_size,), bias=bias)


_CALL = call_entry(_KERNEL.source, "leanlm_linear_sparse24_call", _KERNEL.cpu_needs)
_INT8_CALL = call_entry(_QUANT_SOURCE, "leanlm_linear_sparse24_int8_call", _INT8_KERNEL.cpu_needs)
_INT4_CALL = call_entry(_QUANT_SOURCE, "leanlm_linear_sparse24_int4_call", _INT4_KERNEL.cpu_needs)


def native_call(values: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None) -> NativeCall | None:
    """The decode loop's call of the 2:4 GEMV: values bf16 [N, K / 2], mask uint8 [N, K / 8], bias bf16 [N] or
    None; None where they do not fit."""
    if not SPEC.fits_partial(None, values, mask, bias):
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
    if bits not in QUANT_SPECS or (zeros is None) == (bits == 4):
        return None
    args = _quant_args(None, codes, mask, scales, zeros, bias, bits)
    if not QUANT_SPECS[bits].fits_partial(*args, group_size):
        return None
    if bits == 4:
        return NativeCall("sparse24_int4", _INT4_CALL, args[1:], (group_size,))
    return NativeCall("sparse24_int8", _INT8_CALL, args[1:], (group_size,))
