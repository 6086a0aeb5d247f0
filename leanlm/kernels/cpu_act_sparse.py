"""A bfloat16 linear layer that skips the weight rows of inputs below a magnitude threshold (activation
sparsity at decode, TEAL/CATS), for a few rows on x86-64 CPUs with AVX512 (F and BW).

The weight is stored transposed, Wt = W^T [K, N], so each input's weights are one contiguous row and a zeroed
input is a row never read: a 40%-sparse input reads 60% of the bytes at batch 1 (the union of the rows' kept
inputs at larger batches). Built and loaded like cpu_gemv.py; `reference` is the PyTorch path it must match.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemv_act_sparse.c"),
    symbol="leanlm_linear_act_sparse",
    argtypes=[_P, _P, ctypes.c_double, _P, _P, _P, _I64, _I64, _I64, _INT, _I64],
    restype=_INT,
    cpu_needs=("avx512f", "avx512bw"),
)
MAX_ROWS = 8  # should_use() accepts up to this many rows (one pass over the active weight rows)
_BF16 = torch.bfloat16


def is_available() -> bool:
    return _KERNEL.is_available()


def unavailable_reason() -> str | None:
    return _KERNEL.unavailable_reason


def sparsify(x: torch.Tensor, threshold: float, column_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] with every entry whose |x_k| * column_scale_k (float32 [K]; 1 when None) is <= threshold set
    to zero: what the kernel multiplies. Compared in float32, as the kernel does."""
    score = x.float().abs()
    if column_scale is not None:
        score = score * column_scale
    return x.masked_fill(score <= threshold, 0)


def reference(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    threshold: float,
    column_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch path: sparsify(x) [..., K] @ weight_t [K, N] + bias."""
    return F.linear(sparsify(x, threshold, column_scale), weight_t.t(), bias)


# the weight transposed [K, N] (an input's weights in one row), a float32 score scale per input [K]
SPEC = KernelSpec(
    _KERNEL,
    "CPU activation-sparse kernel",
    [
        Arg("x", _BF16, (ROWS, "K")),
        Arg("weight_t", _BF16, ("K", "N")),
        Arg("column_scale", torch.float32, ("K",), optional=True),
        Arg("bias", _BF16, ("N",), optional=True),
    ],
)


def should_use(x, weight_t, column_scale=None, bias=None) -> bool:
    """Policy: contiguous bf16 CPU x [..., K] of at most MAX_ROWS rows, weight_t [K, N], bias [N]."""
    return SPEC.rows_fit(x, weight_t, column_scale, bias, max_rows=MAX_ROWS) and is_available()


def linear_act_sparse(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    threshold: float,
    column_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sparsify(x, threshold, column_scale) [..., K] @ weight_t [K, N] + bias -> bf16 [..., N]; fp32 sums (split
    over threads by ranges of k), one rounding. Any number of rows works (the weight is re-read every MAX_ROWS
    rows)."""
    if not SPEC.fits(x, weight_t, column_scale, bias):
        SPEC.explain(x, weight_t, column_scale, bias)
    K, N = weight_t.shape
    return SPEC.linear(x, N, K, (x, weight_t, float(threshold), column_scale, bias), bias=bias)


_CALL = call_entry(_KERNEL.source, "leanlm_linear_act_sparse_call", _KERNEL.cpu_needs)


def native_call(
    weight_t: torch.Tensor, threshold: torch.Tensor, column_scale: torch.Tensor, bias: torch.Tensor | None
) -> NativeCall | None:
    """The decode loop's call of this kernel: weight_t bf16 [K, N], threshold float32 [1], column_scale float32
    [K], bias bf16 [N] or None; None where they do not fit."""
    threshold_ok = threshold.dtype == torch.float32 and threshold.numel() == 1
    if not (threshold_ok and column_scale is not None and SPEC.fits_partial(None, weight_t, column_scale, bias)):
        return None
    return NativeCall("act_sparse", _CALL, (weight_t, threshold, column_scale, bias))
