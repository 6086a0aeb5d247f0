"""A bfloat16 linear layer for a few rows (batch-1..8 decode) on x86-64 CPUs with AVX512-BF16.

Compiles gemv_bf16.c on first use into the kernel cache (`$LEANLM_CACHE/kernels` or
`~/.cache/leanlm/kernels`), keyed by a hash of the source and the build command, and calls it through
ctypes. The library links against torch's own libgomp so the process keeps a single OpenMP runtime.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec

_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemv_bf16.c"),
    symbol="leanlm_linear_bf16",
    argtypes=[ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64],
    restype=ctypes.c_int,
)
MAX_ROWS = 8  # should_use() accepts up to this many rows of x (one pass over W)
_BF16 = torch.bfloat16
SPEC = KernelSpec(
    _KERNEL,
    "CPU bf16 GEMV kernel",
    [Arg("x", _BF16, (ROWS, "K")), Arg("weight", _BF16, ("N", "K")), Arg("bias", _BF16, ("N",), optional=True)],
)


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16, a C compiler)."""
    return _KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _KERNEL.unavailable_reason


def should_use(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Policy: route F.linear(x, weight) here for contiguous bf16 CPU tensors with at most MAX_ROWS rows."""
    return SPEC.rows_fit(x, weight, None, max_rows=MAX_ROWS) and is_available()


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 CPU tensors: x [..., K] @ weight[N, K]^T + bias[N] -> [..., N], fp32 accumulation.

    x, weight and bias must be contiguous bfloat16 on the CPU (checked: the C code reads raw pointers).
    Any number of rows works, but W is re-read every MAX_ROWS rows, so it only pays for small M.
    Runs on torch.get_num_threads() threads.
    """
    if not SPEC.fits(x, weight, bias):
        SPEC.explain(x, weight, bias)
    N, K = weight.shape
    return SPEC.linear(x, N, K, (x, weight, bias), bias=bias)


_CALL = call_entry(Path(__file__).with_name("gemv_bf16.c"), "leanlm_linear_bf16_call")


def native_call(weight: torch.Tensor, bias: torch.Tensor | None) -> NativeCall | None:
    """The decode loop's call of this GEMV on weight bf16 [N, K] and bias bf16 [N] (or None); None where the
    tensors are not what the kernel reads."""
    if not SPEC.fits_partial(None, weight, bias):
        return None
    return NativeCall("bf16", _CALL, (weight, bias))
