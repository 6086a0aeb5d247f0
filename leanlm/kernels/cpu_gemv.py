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
from leanlm.kernels.native_linear import NativeCall, bias_fits, call_entry

_KERNEL = NativeKernel(
    source=Path(__file__).with_name("gemv_bf16.c"),
    symbol="leanlm_linear_bf16",
    argtypes=[ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64],
    restype=ctypes.c_int,
)
MAX_ROWS = 8  # should_use() accepts up to this many rows of x (one pass over W)
# Below this many weight bytes one thread does the whole matrix: waking the OpenMP pool costs a few
# microseconds, about what a second core saves on a small matrix.
MIN_PARALLEL_BYTES = 64 * 1024


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16, a C compiler)."""
    return _KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _KERNEL.unavailable_reason


def should_use(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Policy: route F.linear(x, weight) here for contiguous bf16 CPU tensors with at most MAX_ROWS rows."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and x.numel() <= MAX_ROWS * weight.shape[1]
        and x.is_contiguous()
        and weight.is_contiguous()
        and is_available()
    )


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The slow path of linear_bf16's argument check: say what is wrong."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match: want [..., K], [N, K]")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {t.dtype} on {t.device}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")


_BF16 = torch.bfloat16


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 CPU tensors: x [..., K] @ weight[N, K]^T + bias[N] -> [..., N], fp32 accumulation.

    x, weight and bias must be contiguous bfloat16 on the CPU (checked: the C code reads raw pointers).
    Any number of rows works, but W is re-read every MAX_ROWS rows, so it only pays for small M.
    Runs on torch.get_num_threads() threads.
    """
    fn = _KERNEL.fn()
    if fn is None:
        raise RuntimeError(f"CPU bf16 GEMV kernel unavailable: {_KERNEL.unavailable_reason}")
    # The fast check (one expression: this runs ~200 times per decoded token); _check_args explains.
    if not (
        weight.dim() == 2
        and x.dtype is _BF16
        and weight.dtype is _BF16
        and x.is_cpu
        and weight.is_cpu
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and (
            bias is None
            or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous() and bias.shape == weight.shape[:1])
        )
    ):
        _check_args(x, weight, bias)
    N, K = weight.shape
    y = torch.empty(x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:  # an empty sum: the bias alone
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // K,
        N,
        K,
        torch.get_num_threads(),
        MIN_PARALLEL_BYTES,
    )
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_bf16 failed (code {rc})")
    return y


_CALL = call_entry(Path(__file__).with_name("gemv_bf16.c"), "leanlm_linear_bf16_call")


def native_call(weight: torch.Tensor, bias: torch.Tensor | None) -> NativeCall | None:
    """The decode loop's call of this GEMV on weight bf16 [N, K] and bias bf16 [N] (or None); None where the
    tensors are not what the kernel reads."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not bias_fits(bias, weight.shape[0]):
        return None
    return NativeCall("bf16", _CALL, (weight, bias))
