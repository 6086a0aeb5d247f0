"""An unstructured-sparse bfloat16 linear layer for a few rows (batch-1..8 decode) on x86-64 CPUs with AVX512-BF16
and AVX512-VBMI2 (Ice Lake and later, Zen 4 and later; not Cooper Lake, which has BF16 only).

The weight stays in BitmaskSparseLinear's saved layout (compressed-tensors' "sparse-bitmask": nonzeros [nnz]
row-major, a bit per weight [N, K / 8], row starts [N]); gemv_bitmask.c widens it in registers, so it reads 2 bytes
per nonzero plus 1/8 byte per weight, and its results equal cpu_gemv.linear_bf16 on the dense weight bit for bit.
Built and loaded like cpu_sparse.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemv_bitmask.c"),
    symbol="leanlm_linear_bitmask",
    argtypes=[_P] * 6 + [_I64] * 3 + [_INT, _I64],
    restype=_INT,
    cpu_needs=("avx512_bf16", "avx512_vbmi2"),
)
MAX_ROWS = 8  # should_use() accepts up to this many rows of x (one pass over W); 9+ rows go to cpu_gemm

_BF16, _U8, _I64T = torch.bfloat16, torch.uint8, torch.int64


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16 and VBMI2, a C compiler)."""
    return _KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _KERNEL.unavailable_reason


# nonzeros [nnz] row-major, a bit per weight [N, K / 8], row starts [N]
SPEC = KernelSpec(
    _KERNEL,
    "CPU bitmask sparse GEMV kernel",
    [
        Arg("x", _BF16, (ROWS, "K")),
        Arg("values", _BF16, ("nnz",)),
        Arg("mask", _U8, ("N", "K/8")),
        Arg("row_offsets", _I64T, ("N",)),
        Arg("bias", _BF16, ("N",), optional=True),
    ],
)


def should_use(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor) -> bool:
    """Policy: route a bitmask linear here for contiguous CPU tensors, bf16 x and values, at most MAX_ROWS rows."""
    return SPEC.rows_fit(x, values, mask, row_offsets, None, max_rows=MAX_ROWS) and is_available()


def linear_bitmask(
    x: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    row_offsets: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T + bias -> bf16 [..., N], W unstructured sparse: values bf16 [nnz], mask uint8 [N, K / 8],
    row_offsets int64 [N] (BitmaskSparseLinear's layout; each row's set bits must count its values, which the layer
    checks on construction: the kernel trusts it). fp32 accumulation, one rounding. Any number of rows works, but
    W is re-read every MAX_ROWS rows. Runs on torch.get_num_threads() threads."""
    if not SPEC.fits(x, values, mask, row_offsets, bias):
        SPEC.explain(x, values, mask, row_offsets, bias)
    N, K = mask.shape[0], 8 * mask.shape[1]
    return SPEC.linear(x, N, K, (x, values, mask, row_offsets, bias), bias=bias)


_CALL = call_entry(_KERNEL.source, "leanlm_linear_bitmask_call", _KERNEL.cpu_needs)


def native_call(
    values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor, bias: torch.Tensor | None
) -> NativeCall | None:
    """The decode loop's call of this kernel: values bf16 [nnz], mask uint8 [N, K / 8], row_offsets int64 [N] (the
    layer checked that they agree), bias bf16 [N] or None; None where they do not fit."""
    if not SPEC.fits_partial(None, values, mask, row_offsets, bias):
        return None
    return NativeCall("bitmask", _CALL, (values, mask, row_offsets, bias))
