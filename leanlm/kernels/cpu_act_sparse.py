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
from leanlm.kernels.native_linear import NativeCall, bias_fits, call_entry
from leanlm.kernels.spec import MIN_PARALLEL_BYTES

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


def _args_ok(x, weight_t, column_scale, bias) -> bool:
    return (
        x.dtype is _BF16
        and weight_t.dtype is _BF16
        and x.is_cpu
        and weight_t.is_cpu
        and x.is_contiguous()
        and weight_t.is_contiguous()
        and weight_t.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight_t.shape[0]
        and (bias is None or (bias.dtype is _BF16 and bias.is_contiguous() and bias.shape == weight_t.shape[1:]))
        and (
            column_scale is None
            or (
                column_scale.dtype is torch.float32
                and column_scale.is_cpu
                and column_scale.is_contiguous()
                and column_scale.shape == weight_t.shape[:1]
            )
        )
    )


def should_use(x, weight_t, column_scale=None, bias=None) -> bool:
    """Policy: contiguous bf16 CPU x [..., K] of at most MAX_ROWS rows, weight_t [K, N], bias [N]."""
    return _args_ok(x, weight_t, column_scale, bias) and x.numel() <= MAX_ROWS * x.shape[-1] and is_available()


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
    fn = _KERNEL.fn()
    if fn is None:
        raise RuntimeError(f"CPU activation-sparse kernel unavailable: {_KERNEL.unavailable_reason}")
    if not _args_ok(x, weight_t, column_scale, bias):
        raise ValueError(
            f"linear_act_sparse takes contiguous bf16 CPU x [..., K], weight_t [K, N], bias [N] and float32 "
            f"column_scale [K]; got x {tuple(x.shape)} {x.dtype}, weight_t {tuple(weight_t.shape)} {weight_t.dtype}"
        )
    K, N = weight_t.shape
    y = torch.empty(x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(
        x.data_ptr(),
        weight_t.data_ptr(),
        float(threshold),
        None if column_scale is None else column_scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        N,
        K,
        torch.get_num_threads(),
        MIN_PARALLEL_BYTES,
    )
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_act_sparse failed (code {rc})")
    return y


_CALL = call_entry(_KERNEL.source, "leanlm_linear_act_sparse_call", _KERNEL.cpu_needs)


def native_call(
    weight_t: torch.Tensor, threshold: torch.Tensor, column_scale: torch.Tensor, bias: torch.Tensor | None
) -> NativeCall | None:
    """The decode loop's call of this kernel: weight_t bf16 [K, N], threshold float32 [1], column_scale float32
    [K], bias bf16 [N] or None; None where they do not fit."""
    if weight_t.dim() != 2 or weight_t.dtype != torch.bfloat16:
        return None
    K, N = weight_t.shape
    ok = threshold.dtype == torch.float32 and threshold.numel() == 1 and bias_fits(bias, N)
    if not (ok and column_scale.dtype == torch.float32 and tuple(column_scale.shape) == (K,)):
        return None
    return NativeCall("act_sparse", _CALL, (weight_t, threshold, column_scale, bias))
