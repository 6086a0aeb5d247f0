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
from leanlm.kernels.cpu_gemv import MIN_PARALLEL_BYTES

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
