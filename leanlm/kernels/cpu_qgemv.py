"""Weight-only int8 / int4 linear layers for a few rows (batch-1..64 decode) on x86-64 CPUs with AVX512-BF16,
and their dequantization to bf16 for many-row products.

Weights are widened to bf16 in registers and multiplied with the unchanged bf16 activations (fp32
accumulation), so results match float64 math on the dequantized weight to bf16 output rounding; see
gemv_quant.c. At M = 1 both kernels stream weights at about the bf16 kernel's rate; from M ~ 4 int4 is
bound by the same vdpbf16ps count as bf16, so it gains less there. Built and loaded like cpu_gemv.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec, Rule, call

_SOURCE = Path(__file__).with_name("gemv_quant.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_INT8_KERNEL = NativeKernel(
    source=_SOURCE, symbol="leanlm_linear_int8", argtypes=[_P] * 5 + [_I64] * 4 + [_INT, _I64], restype=_INT
)
_INT4_KERNEL = NativeKernel(
    source=_SOURCE, symbol="leanlm_linear_int4", argtypes=[_P] * 6 + [_I64] * 4 + [_INT, _I64], restype=_INT
)
_DEQUANT_INT8 = NativeKernel(
    source=_SOURCE, symbol="leanlm_dequantize_int8", argtypes=[_P] * 3 + [_I64] * 3 + [_INT], restype=None
)
_DEQUANT_INT4 = NativeKernel(
    source=_SOURCE, symbol="leanlm_dequantize_int4", argtypes=[_P] * 4 + [_I64] * 3 + [_INT], restype=None
)
# should_use_*() accept up to this many rows of x. The kernels re-read the weight every 8 rows, yet up to
# about 64 rows that beats dequantizing the whole weight for a GEMM (1 thread, SmolLM2's 1536 x 576: int8
# 1.0 vs 1.6 ms at 64 rows, int4 1.4 vs 13 ms with torch's dequantization).
MAX_ROWS = 64

_BF16, _F32, _I8, _U8 = torch.bfloat16, torch.float32, torch.int8, torch.uint8


def is_available() -> bool:
    """True when the kernels are built and loaded (x86-64 Linux, AVX512-BF16, a C compiler)."""
    return _INT8_KERNEL.is_available() and _INT4_KERNEL.is_available()


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    return _INT8_KERNEL.unavailable_reason or _INT4_KERNEL.unavailable_reason


def int8_group_ok(group_size: int | None, K: int) -> bool:
    """None (per channel), 16 (GGUF Q6_K) or a positive multiple of 32, dividing K (then a multiple of 32):
    the group sizes the int8 kernel takes."""
    if group_size is None:
        return True
    return (
        type(group_size) is int
        and group_size > 0
        and (group_size % 32 == 0 or group_size == 16)
        and K % group_size == 0
        and K % 32 == 0
    )


def _int4_group_ok(group_size: int, K: int) -> bool:
    return type(group_size) is int and group_size > 0 and group_size % 32 == 0 and K % group_size == 0


_INT8_RULE = Rule(
    ("G", "K"),
    int8_group_ok,
    "group_size must be None, 16 or a multiple of 32, dividing K = {K} (itself a multiple of 32), not {G!r}",
)
_INT4_RULE = Rule(
    ("G", "K"), _int4_group_ok, "group_size must be an int, a positive multiple of 32 that divides K = {K}, not {G!r}"
)
_X, _BIAS = Arg("x", _BF16, (ROWS, "K")), Arg("bias", _BF16, ("N",), optional=True)
_INT8_WHAT, _INT4_WHAT = "CPU int8 GEMV kernel", "CPU int4 GEMV kernel"
# int8 codes [N, K] with scales per output channel [N], or per group of G inputs [N, K / G]
INT8_SPEC = KernelSpec(
    _INT8_KERNEL, _INT8_WHAT, [_X, Arg("qweight", _I8, ("N", "K")), Arg("scales", _F32, ("N",)), _BIAS]
)
INT8_GROUPED_SPEC = KernelSpec(
    _INT8_KERNEL,
    _INT8_WHAT,
    [_X, Arg("qweight", _I8, ("N", "K")), Arg("scales", _F32, ("N", "K/G")), _BIAS],
    given=("G",),
    rules=(_INT8_RULE,),
)
# two 4-bit codes a byte [N, K / 2] with scales and mins per group of G inputs
INT4_SPEC = KernelSpec(
    _INT4_KERNEL,
    _INT4_WHAT,
    [
        _X,
        Arg("qweight", _U8, ("N", "K/2")),
        Arg("scales", _F32, ("N", "K/G")),
        Arg("mins", _F32, ("N", "K/G")),
        _BIAS,
    ],
    given=("G",),
    rules=(_INT4_RULE,),
)


def _int8_spec(group_size: int | None) -> tuple[KernelSpec, tuple]:
    return (INT8_SPEC, ()) if group_size is None else (INT8_GROUPED_SPEC, (group_size,))


def should_use_int8(x: torch.Tensor, qweight: torch.Tensor, group_size: int | None = None) -> bool:
    """Policy: route an int8 linear here for contiguous CPU tensors with at most MAX_ROWS rows of bf16 x
    (per channel, or in groups of a multiple of 32 dividing K)."""
    spec, given = _int8_spec(group_size)
    return spec.rows_fit(x, qweight, None, None, *given, max_rows=MAX_ROWS) and is_available()


def should_use_int4(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Policy: as should_use_int8, for packed int4 weights [N, K // 2] with a supported group_size."""
    return INT4_SPEC.rows_fit(x, qweight, None, None, None, group_size, max_rows=MAX_ROWS) and is_available()


def linear_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ (qweight[N, K] * scales)^T + bias[N] -> bf16 [..., N], fp32 accumulation.

    x: contiguous bf16; qweight: contiguous int8 (symmetric); scales: float32 [N] per output channel
    (group_size None), or [N, K // group_size] per group of group_size input columns (16 or a multiple of
    32, dividing K: GGUF Q6_K, Q8_0 and Q5_0 blocks); bias: bf16 [N] or None; all on the CPU (checked: the C code
    reads raw pointers). Any number of rows works, but the weight is re-read every 8 rows. Runs on
    torch.get_num_threads() threads.
    """
    spec, given = _int8_spec(group_size)
    if not spec.fits(x, qweight, scales, bias, *given):
        spec.explain(x, qweight, scales, bias, *given)
    N, K = qweight.shape
    inputs = (x, qweight, scales, bias)
    return spec.linear(x, N, K, inputs, (K if group_size is None else group_size,), bias=bias)


def linear_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ w^T + bias -> bf16 [..., N] for group-quantized 4-bit (or fewer-bit) codes.

    qweight: uint8 [N, K // 2]; weight (n, k) is the code q in 0..15 in byte k // 2 of row n, low nibble
    for even k, high nibble for odd k. scales, mins: float32 [N, K // group_size];
    w[n, k] = q * scales[n, g] + mins[n, g] with g = k // group_size (asymmetric zero points: mins =
    -zero * scale). group_size: a multiple of 32 dividing K. x, bias: bf16 as in linear_int8.
    """
    if not INT4_SPEC.fits(x, qweight, scales, mins, bias, group_size):
        INT4_SPEC.explain(x, qweight, scales, mins, bias, group_size)
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    return INT4_SPEC.linear(x, N, K, (x, qweight, scales, mins, bias), (group_size,), bias=bias)


_DEQ_INT8 = KernelSpec(
    _DEQUANT_INT8, "CPU int8 dequantization", [Arg("qweight", _I8, ("N", "K")), Arg("scales", _F32, ("N",))]
)
_DEQ_INT8_GROUPED = KernelSpec(
    _DEQUANT_INT8,
    "CPU int8 dequantization",
    [Arg("qweight", _I8, ("N", "K")), Arg("scales", _F32, ("N", "K/G"))],
    given=("G",),
    rules=(_INT8_RULE,),
)
_DEQ_INT4 = KernelSpec(
    _DEQUANT_INT4,
    "CPU int4 dequantization",
    [Arg("qweight", _U8, ("N", "K/2")), Arg("scales", _F32, ("N", "K/G")), Arg("mins", _F32, ("N", "K/G"))],
    given=("G",),
    # any positive group dividing K: the dequantization has no 32-column steps
    rules=(
        Rule(
            ("G", "K"),
            lambda G, K: type(G) is int and G > 0 and K % G == 0,
            "group_size must be a positive int dividing K = {K}, not {G!r}",
        ),
    ),
)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """bf16 [N, K] = qweight [N, K] int8 * scales ([N], or [N, K / group_size] per group) (fp32 product, one
    rounding), on all threads."""
    spec, given = (_DEQ_INT8, ()) if group_size is None else (_DEQ_INT8_GROUPED, (group_size,))
    if not spec.fits(qweight, scales, *given):
        spec.explain(qweight, scales, *given)
    N, K = qweight.shape
    out = torch.empty(N, K, dtype=_BF16)
    threads = torch.get_num_threads()
    call(spec.fn(), spec.kernel.symbol, qweight, scales, out, N, K, group_size or K, threads)
    return out


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [N, K] = q * scales + mins per group (fp32 product then sum, one rounding) from packed codes
    [N, K / 2] (low nibble first); the stored column order (no act-order permutation)."""
    if not _DEQ_INT4.fits(qweight, scales, mins, group_size):
        _DEQ_INT4.explain(qweight, scales, mins, group_size)
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    out = torch.empty(N, K, dtype=_BF16)
    threads = torch.get_num_threads()
    call(_DEQ_INT4.fn(), _DEQ_INT4.kernel.symbol, qweight, scales, mins, out, N, K, group_size, threads)
    return out


_INT8_CALL = call_entry(_SOURCE, "leanlm_linear_int8_call")
_INT4_CALL = call_entry(_SOURCE, "leanlm_linear_int4_call")


def int8_native_call(
    qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int | None
) -> NativeCall | None:
    """The decode loop's call of the int8 GEMV: codes int8 [N, K], scales float32 [N] (group_size None) or
    [N, K / group_size], bias bf16 [N] or None; None where the tensors are not what it reads."""
    spec, given = _int8_spec(group_size)
    if not spec.fits_partial(None, qweight, scales, bias, *given):
        return None
    return NativeCall("int8", _INT8_CALL, (qweight, scales, bias), (group_size or qweight.shape[1],))


def int4_native_call(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> NativeCall | None:
    """The decode loop's call of the 2-4 bit GEMV: codes uint8 [N, K / 2], scales and mins float32
    [N, K / group_size] (group_size a multiple of 32), bias bf16 [N] or None; None where they do not fit."""
    if not INT4_SPEC.fits_partial(None, qweight, scales, mins, bias, group_size):
        return None
    return NativeCall("int4", _INT4_CALL, (qweight, scales, mins, bias), (group_size,))
