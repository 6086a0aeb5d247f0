"""Dense float32 linear layers at the AVX2 level (gemv_f32_avx2.c): the few-row GEMV the float32 decode loop calls
for a dense model's linears, so a float32 model of plain weights (what dtype="auto" gives a CPU without
AVX512-BF16) runs the native loop instead of PyTorch op by op. Forward passes outside the loop keep F.linear
(MKL's sgemv / sgemm, already bound by memory there). Built and loaded like cpu_qgemv_avx2.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec

_SOURCE = Path(__file__).with_name("gemv_f32_avx2.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_AVX2 = {"cpu_needs": (), "level": "avx2"}
_KERNEL = NativeKernel(_SOURCE, "leanlm_linear_f32", [_P] * 4 + [_I64] * 3 + [_INT, _I64], _INT, **_AVX2)
_CALL = call_entry(_SOURCE, "leanlm_linear_f32_call", **_AVX2)
_F32 = torch.float32
SPEC = KernelSpec(
    _KERNEL,
    "CPU float32 GEMV kernel (AVX2)",
    [Arg("x", _F32, (ROWS, "K")), Arg("weight", _F32, ("N", "K")), Arg("bias", _F32, ("N",), optional=True)],
    out_dtype=_F32,
)


def is_available() -> bool:
    """The kernel is built and loaded (x86-64 Linux, AVX2 + FMA, a C compiler, the level allowed)."""
    return _KERNEL.is_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias -> float32 [..., N]; contiguous float32 CPU tensors."""
    if not SPEC.fits(x, weight, bias):
        SPEC.explain(x, weight, bias)
    N, K = weight.shape
    return SPEC.linear(x, N, K, (x, weight, bias), bias=bias)


def native_call(weight: torch.Tensor, bias: torch.Tensor | None) -> NativeCall | None:
    """The float32 decode loop's call of the GEMV for a dense float32 weight [N, K] (bias float32 [N] or None);
    None where they are not what it reads (another dtype, not contiguous, not on the CPU)."""
    if not SPEC.fits_partial(None, weight, bias):
        return None
    return NativeCall("f32", _CALL, (weight, bias))
