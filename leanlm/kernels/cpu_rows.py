"""Row helpers shared by the native decode loop and the PyTorch path (exported from decode_layers.c): RMSNorm
and SiLU-and-multiply on bf16 rows, with the loop's arithmetic, so a step's bits do not depend on which path
ran it; and the sampler's argmax over bf16 logits."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SOURCE = Path(__file__).with_name("decode_layers.c")
_RMS_NORM = NativeKernel(
    source=_SOURCE,
    symbol="leanlm_rms_norm_bf16",
    argtypes=[_P] * 3 + [_I64] * 2 + [ctypes.c_double, _INT],
    restype=None,
)
_SILU_MUL = NativeKernel(source=_SOURCE, symbol="leanlm_silu_mul_bf16", argtypes=[_P] * 3 + [_I64, _INT], restype=None)
_ARGMAX = NativeKernel(
    source=_SOURCE, symbol="leanlm_argmax_bf16", argtypes=[_P] * 2 + [_I64] * 2 + [_INT], restype=None
)
_ROUTE = NativeKernel(
    source=_SOURCE, symbol="leanlm_moe_route_bf16", argtypes=[_P] * 2 + [_I64] * 5 + [_P] * 2, restype=_INT
)
_BF16 = torch.bfloat16
ROUTE_SCORINGS = ("softmax", "softmax_renorm", "ones")  # the C codes 0, 1, 2


def should_use_rows(x: torch.Tensor) -> bool:
    """Policy for rms_norm / silu_and_mul: contiguous bf16 CPU rows (any number: the native loop runs every
    decode step's norms and SiLU on these functions, so the PyTorch path runs them too and both agree)."""
    return x.dtype is _BF16 and x.is_cpu and x.is_contiguous() and x.dim() == 2 and _RMS_NORM.is_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 rows x [M, n] with a bf16 weight [n], in fp32 with one rounding: the function the
    native loop runs, so its steps agree bit for bit whichever path runs them (see should_use_rows)."""
    if not (should_use_rows(x) and weight.dtype is _BF16 and weight.is_contiguous() and weight.shape == x.shape[1:]):
        raise ValueError("rms_norm takes contiguous bf16 CPU rows [M, n] and a bf16 weight [n]")
    y = torch.empty_like(x)
    _RMS_NORM.fn()(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return y


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up) for bf16 rows [M, n], as F.silu(gate) * up rounds, in the native loop's
    arithmetic (see rms_norm)."""
    if not (should_use_rows(gate) and up.dtype is _BF16 and up.is_contiguous() and up.shape == gate.shape):
        raise ValueError("silu_and_mul takes two contiguous bf16 CPU tensors [M, n] of one shape")
    y = torch.empty_like(gate)
    _SILU_MUL.fn()(gate.data_ptr(), up.data_ptr(), y.data_ptr(), gate.numel(), torch.get_num_threads())
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for rows x [M, n]: natively for contiguous bf16 CPU rows (torch's bf16 argmax is about 5x
    slower than its float32 one), else torch's. Same indices: the first largest, NaN counting as largest."""
    if not (x.dtype is _BF16 and x.is_cpu and x.is_contiguous() and x.dim() == 2 and x.shape[1] > 0):
        return x.argmax(dim=-1)
    fn = _ARGMAX.fn()
    if fn is None:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def can_route(x: torch.Tensor, router: torch.Tensor) -> bool:
    """Whether moe_route takes these rows: the native loop's own routing, for contiguous bf16 CPU rows."""
    return should_use_rows(x) and router.dtype is _BF16 and router.is_contiguous() and _ROUTE.is_available()


def moe_route(x: torch.Tensor, router: torch.Tensor, top_k: int, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [M, k] int64 in ascending index order, weights [M, k] float32) of bf16 rows x [M, hidden] under a bf16
    router [E, hidden], as the native decode loop routes: logits rounded to bf16, softmax in fp32, ties to the lower
    index."""
    if not can_route(x, router) or router.shape[1] != x.shape[1]:
        raise ValueError("moe_route takes contiguous bf16 CPU rows [M, hidden] and a bf16 router [E, hidden]")
    return _route(_ROUTE, "moe_route", x, router, top_k, scoring, "at most 1024 experts and 1 <= top_k <= experts")


_ROUTE_F32 = NativeKernel(
    source=Path(__file__).with_name("decode_layers_f32.c"),
    symbol="leanlm_moe_route_f32",
    argtypes=[_P] * 2 + [_I64] * 5 + [_P] * 2,
    restype=_INT,
    cpu_needs=(),
    level="avx2",
)


def moe_route_f32(x: torch.Tensor, router: torch.Tensor, top_k: int, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [M, k] int64 in ascending index order, weights [M, k] float32) of float32 rows x [M, hidden] under a
    float32 router [E, hidden], as the float32 decode loop routes (route()'s math: fp32 logits and softmax, the k
    largest probabilities; ties to the lower index). hidden must be a multiple of 8."""
    ok = x.dtype is router.dtype is torch.float32 and x.is_cpu and router.is_cpu and x.dim() == 2
    if not (ok and x.is_contiguous() and router.is_contiguous() and router.shape[1] == x.shape[1]):
        raise ValueError("moe_route_f32 takes contiguous float32 CPU rows [M, hidden] and a router [E, hidden]")
    return _route(
        _ROUTE_F32,
        "moe_route_f32",
        x,
        router,
        top_k,
        scoring,
        "at most 1024 experts, 1 <= top_k <= experts, hidden % 8",
    )


def _route(
    kernel: NativeKernel, name: str, x: torch.Tensor, router: torch.Tensor, top_k: int, scoring: str, limits: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a checked routing kernel over rows x [M, hidden]: (experts [M, k] int64, weights [M, k] float32)."""
    experts = torch.empty(x.shape[0], top_k, dtype=torch.int64)
    weights = torch.empty(x.shape[0], top_k, dtype=torch.float32)
    rc = kernel.fn()(x.data_ptr(), router.data_ptr(), x.shape[0], x.shape[1], router.shape[0], top_k,
                     ROUTE_SCORINGS.index(scoring), experts.data_ptr(), weights.data_ptr())  # fmt: skip
    if rc != 0:
        raise ValueError(f"{name} failed (code {rc}): {limits}")
    return experts, weights
