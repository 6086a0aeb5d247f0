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
from leanlm.kernels.native_linear import NativeCall, bias_fits, call_entry
from leanlm.kernels.spec import MIN_PARALLEL_BYTES

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


def _is_cpu_contiguous(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous()


def should_use(x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor) -> bool:
    """Policy: route a bitmask linear here for contiguous CPU tensors, bf16 x and values, at most MAX_ROWS rows."""
    return (
        values.dim() == 1
        and mask.dim() == 2
        and _is_cpu_contiguous(values, _BF16)
        and _is_cpu_contiguous(mask, _U8)
        and _is_cpu_contiguous(row_offsets, _I64T)
        and _is_cpu_contiguous(x, _BF16)
        and x.dim() >= 1
        and x.shape[-1] == 8 * mask.shape[1]
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and is_available()
    )


def _check_args(
    x: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """The slow path of linear_bitmask's argument check: say what is wrong."""
    if values.dim() != 1 or mask.dim() != 2 or row_offsets.dim() != 1:
        raise ValueError(
            f"values {tuple(values.shape)}, mask {tuple(mask.shape)} and row_offsets {tuple(row_offsets.shape)} "
            "must be [nnz], [N, K/8] and [N]"
        )
    N, K = mask.shape[0], 8 * mask.shape[1]
    if row_offsets.shape != (N,):
        raise ValueError(f"row_offsets has shape {tuple(row_offsets.shape)}; mask {tuple(mask.shape)} needs ({N},)")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x {tuple(x.shape)} does not match mask {tuple(mask.shape)}: want x [..., {K}]")
    for name, t, dtype in (("mask", mask, _U8), ("row_offsets", row_offsets, _I64T)):
        if not _is_cpu_contiguous(t, dtype):
            raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, not {t.dtype} on {t.device}")
    for name, t in (("x", x), ("values", values), ("bias", bias)):
        if t is not None and not _is_cpu_contiguous(t, _BF16):
            raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {t.dtype} on {t.device}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({N},)")


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
    fn = _KERNEL.fn()
    if fn is None:
        raise RuntimeError(f"CPU bitmask sparse GEMV kernel unavailable: {_KERNEL.unavailable_reason}")
    # The fast check (one expression: this runs ~200 times per decoded token); _check_args explains.
    if not (
        values.dim() == 1
        and mask.dim() == 2
        and x.dim() >= 1
        and x.dtype is _BF16
        and values.dtype is _BF16
        and mask.dtype is _U8
        and row_offsets.dtype is _I64T
        and x.is_cpu
        and values.is_cpu
        and mask.is_cpu
        and row_offsets.is_cpu
        and x.is_contiguous()
        and values.is_contiguous()
        and mask.is_contiguous()
        and row_offsets.is_contiguous()
        and x.shape[-1] == 8 * mask.shape[1]
        and row_offsets.shape == mask.shape[:1]
        and (
            bias is None
            or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous() and bias.shape == mask.shape[:1])
        )
    ):
        _check_args(x, values, mask, row_offsets, bias)
    N, K = mask.shape[0], x.shape[-1]
    y = torch.empty((x.shape[0], N) if x.dim() == 2 else x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:  # an empty sum: the bias alone
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(
        x.data_ptr(),
        values.data_ptr(),
        mask.data_ptr(),
        row_offsets.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        N,
        K,
        torch.get_num_threads(),
        MIN_PARALLEL_BYTES,
    )
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_bitmask failed (code {rc})")
    return y


_CALL = call_entry(_KERNEL.source, "leanlm_linear_bitmask_call", _KERNEL.cpu_needs)


def native_call(
    values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor, bias: torch.Tensor | None
) -> NativeCall | None:
    """The decode loop's call of this kernel: values bf16 [nnz], mask uint8 [N, K / 8], row_offsets int64 [N] (the
    layer checked that they agree), bias bf16 [N] or None; None where they do not fit."""
    ok = values.dtype == torch.bfloat16 and values.dim() == 1 and mask.dtype == torch.uint8 and mask.dim() == 2
    ok = ok and row_offsets.dtype == torch.int64 and tuple(row_offsets.shape) == (mask.shape[0],)
    if not (ok and bias_fits(bias, mask.shape[0])):
        return None
    return NativeCall("bitmask", _CALL, (values, mask, row_offsets, bias))
