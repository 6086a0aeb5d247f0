"""Weight-only int4 / int8 linear layers with float32 activations on x86-64 CPUs with AVX2 and FMA (the `avx2` level
of isa.py: the native path of CPUs without AVX512-BF16, such as AMD before Zen 4, Intel client chips and older
Xeons; float32 models run it on the others too): the few-row GEMVs of decode, exact or on int8 activations (W4A8 /
W8A8), and dequantization to float32 for many-row products.

The weights stay packed (4 or 8 bits a code); a decode step reads each code once and never writes a float copy of
the weight, where the PyTorch path dequantizes every weight on every call. Results equal float64 math on the
dequantized weight to fp32 rounding: see gemv_quant_avx2.c. Built and loaded like cpu_qgemv.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec, Rule, call

_SOURCE = Path(__file__).with_name("gemv_quant_avx2.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_AVX2 = {"cpu_needs": (), "level": "avx2"}
_INT4_KERNEL = NativeKernel(
    _SOURCE, "leanlm_linear_int4_f32", [_P] * 6 + [_I64] * 4 + [_INT, _I64], _INT, **_AVX2
)  # fmt: skip
_INT4_A8_KERNEL = NativeKernel(
    _SOURCE, "leanlm_linear_int4_a8_f32", [_P] * 6 + [_I64] * 5 + [_INT, _I64], _INT, **_AVX2
)  # fmt: skip
_INT8_KERNEL = NativeKernel(_SOURCE, "leanlm_linear_int8_f32", [_P] * 5 + [_I64] * 4 + [_INT, _I64], _INT, **_AVX2)
_INT8_A8_KERNEL = NativeKernel(
    _SOURCE, "leanlm_linear_int8_a8_f32", [_P] * 5 + [_I64] * 4 + [_INT, _I64], _INT, **_AVX2
)  # fmt: skip
_DEQUANT_INT4 = NativeKernel(_SOURCE, "leanlm_dequantize_int4_f32", [_P] * 4 + [_I64] * 3 + [_INT], None, **_AVX2)
_DEQUANT_INT8 = NativeKernel(_SOURCE, "leanlm_dequantize_int8_f32", [_P] * 3 + [_I64] * 3 + [_INT], None, **_AVX2)
# The GEMVs take up to this many rows; beyond, one float32 dequantization and one sgemm (MKL / oneDNN) win. They
# hold at most 4 rows in registers and re-read the (cached) weight for each 4. SmolLM2's 1536 x 576 and 576 x 1536
# on 2 threads of a Zen 3 (ms, GEMV / dequantize + sgemm): float32 x at 16 rows 0.56 / 0.67, 32 rows 0.98 / 0.85;
# int8 x (W4A8, whose inner step is 2 vpmaddubsw per 64 codes) at 64 rows 1.15-1.67 / 1.32-1.83, 128 rows
# 3.1-3.4 / 2.3-2.7.
MAX_ROWS = 16
MAX_ROWS_A8 = 64

_F32, _I8, _U8 = torch.float32, torch.int8, torch.uint8


def is_available() -> bool:
    """True when the kernels are built and loaded (x86-64 Linux, AVX2 + FMA, a C compiler, the level allowed)."""
    return _INT4_KERNEL.is_available() and _INT8_KERNEL.is_available()


def act_int8_is_available() -> bool:
    """The W4A8 and W8A8 GEMVs (int8 activations) are built and loaded."""
    return _INT4_A8_KERNEL.is_available() and _INT8_A8_KERNEL.is_available()


def unavailable_reason() -> str | None:
    return _INT4_KERNEL.unavailable_reason or _INT8_KERNEL.unavailable_reason


def _int4_group_ok(G: int, K: int) -> bool:
    return type(G) is int and G > 0 and G % 32 == 0 and K % G == 0


def _int8_group_ok(G: int, K: int) -> bool:
    return type(G) is int and G > 0 and G % 8 == 0 and K % G == 0


_X, _BIAS = Arg("x", _F32, (ROWS, "K")), Arg("bias", _F32, ("N",), optional=True)
INT4_SPEC = KernelSpec(
    _INT4_KERNEL,
    "CPU int4 GEMV kernel (AVX2)",
    [_X, Arg("qweight", _U8, ("N", "K/2")), Arg("scales", _F32, ("N", "K/G")), Arg("mins", _F32, ("N", "K/G")), _BIAS],
    given=("G",),
    rules=(Rule(("G", "K"), _int4_group_ok, "group_size must be a multiple of 32 dividing K = {K}, not {G!r}"),),
    out_dtype=_F32,
)


def a8_groups_fit(G: int, K: int) -> bool:
    """What the W4A8 kernel's 64-code steps take: K a multiple of 64, groups of 32 or of a multiple of 64."""
    return type(G) is int and G > 0 and K % 64 == 0 and K % G == 0 and (G == 32 or G % 64 == 0)


_A8_RULE = Rule(("G", "K"), a8_groups_fit, "int8 activations need K % 64 == 0 and groups of 32 or of 64k, not {G!r}")
# W4A8: the same tensors, x quantized to int8 in groups of 32 inside the kernel (cpu_a8.reference's arithmetic);
# the second given int says the scales and mins are half (INT4_A8_HALF_SPEC)
INT4_A8_SPEC = KernelSpec(
    _INT4_A8_KERNEL,
    "CPU int4 GEMV kernel with int8 activations (AVX2)",
    INT4_SPEC.args,
    given=("G", "half"),
    rules=(_A8_RULE,),
    out_dtype=_F32,
)
INT4_A8_HALF_SPEC = KernelSpec(
    _INT4_A8_KERNEL,
    "CPU int4 GEMV kernel with int8 activations (AVX2, half scales)",
    [
        _X,
        Arg("qweight", _U8, ("N", "K/2")),
        Arg("scales", torch.float16, ("N", "K/G")),
        Arg("mins", torch.float16, ("N", "K/G")),
        _BIAS,
    ],
    given=("G", "half"),
    rules=(_A8_RULE,),
    out_dtype=_F32,
)


def half_copies(scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...] | None:
    """(scales, mins) as half where that is exact (GGUF's Q4_0 / Q4_1 keep theirs so) and the kernel reads half
    ones: 2 bytes less per group each, a sixth of a 4-bit layer's bytes. None otherwise."""
    K = scales.shape[-1] * group_size
    if not (a8_groups_fit(group_size, K) and _INT4_A8_KERNEL.is_available()):
        return None
    halves = scales.half(), mins.half()
    exact = all(torch.equal(h.float(), f) for h, f in zip(halves, (scales, mins), strict=True))
    return halves if exact else None


# int8 codes [N, K], scales per group of G inputs [N, K / G]; per channel is G = K with scales viewed [N, 1]
INT8_SPEC = KernelSpec(
    _INT8_KERNEL,
    "CPU int8 GEMV kernel (AVX2)",
    [_X, Arg("qweight", _I8, ("N", "K")), Arg("scales", _F32, ("N", "K/G")), _BIAS],
    given=("G",),
    rules=(Rule(("G", "K"), _int8_group_ok, "group_size must be a multiple of 8 dividing K = {K}, not {G!r}"),),
    out_dtype=_F32,
)


# W8A8: int8 codes with x quantized per 32 inside the kernel; weight groups (G = K per channel) of whole 32s
INT8_A8_SPEC = KernelSpec(
    _INT8_A8_KERNEL,
    "CPU int8 GEMV kernel with int8 activations (AVX2)",
    INT8_SPEC.args,
    given=("G",),
    rules=(Rule(("G", "K"), _int4_group_ok, "group_size must be a multiple of 32 dividing K = {K}, not {G!r}"),),
    out_dtype=_F32,
)


def _int8_group(qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, int]:
    """(scales [N, K / G], G): per channel (group_size None) is one group of K."""
    if group_size is None:
        return scales.view(-1, 1), qweight.shape[-1]
    return scales, group_size


def should_use_int4(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Policy: float32 rows (at most MAX_ROWS) over packed int4 codes [N, K // 2] in groups of a multiple of 32."""
    return INT4_SPEC.rows_fit(x, qweight, None, None, None, group_size, max_rows=MAX_ROWS) and is_available()


def should_use_int8(x: torch.Tensor, qweight: torch.Tensor, group_size: int | None) -> bool:
    """Policy: float32 rows (at most MAX_ROWS) over int8 codes [N, K], per channel or in groups of a multiple of 8."""
    G = qweight.shape[-1] if group_size is None else group_size
    return INT8_SPEC.rows_fit(x, qweight, None, None, G, max_rows=MAX_ROWS) and is_available()


def linear_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ w^T + bias -> float32 [..., N], w[n, k] = q * scales[n, g] + mins[n, g] with g = k // group_size
    and q the code in byte k // 2 of row n (low nibble for even k). x, scales, mins, bias: contiguous float32 CPU
    tensors; qweight uint8 [N, K // 2]. Runs on torch.get_num_threads() threads."""
    if not INT4_SPEC.fits(x, qweight, scales, mins, bias, group_size):
        INT4_SPEC.explain(x, qweight, scales, mins, bias, group_size)
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    return INT4_SPEC.linear(x, N, K, (x, qweight, scales, mins, bias), (group_size,), bias=bias)


def should_use_int4_a8(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Policy: as should_use_int4, for int8 activations."""
    return (
        INT4_A8_SPEC.rows_fit(x, qweight, None, None, None, group_size, 0, max_rows=MAX_ROWS_A8)
        and _INT4_A8_KERNEL.is_available()
    )


def linear_int4_a8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear_int4 on x quantized to int8 per 32 inputs (act_int8.quantize_act_int8): W4A8, as llama.cpp's Q4_1 x
    Q8_1 dot products; equals cpu_a8.reference to fp32 rounding. scales and mins: float32, or half
    (half_copies)."""
    half = int(scales.dtype is torch.float16)
    spec = INT4_A8_HALF_SPEC if half else INT4_A8_SPEC
    if not spec.fits(x, qweight, scales, mins, bias, group_size, half):
        spec.explain(x, qweight, scales, mins, bias, group_size, half)
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    return spec.linear(x, N, K, (x, qweight, scales, mins, bias), (group_size, half), bias=bias)


def should_use_int8_a8(x: torch.Tensor, qweight: torch.Tensor, group_size: int | None) -> bool:
    """Policy: as should_use_int8, for int8 activations (weight groups of a multiple of 32, or per channel with K
    a multiple of 32)."""
    G = qweight.shape[-1] if group_size is None else group_size
    return INT8_A8_SPEC.rows_fit(x, qweight, None, None, G, max_rows=MAX_ROWS_A8) and _INT8_A8_KERNEL.is_available()


def linear_int8_a8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """linear_int8 on x quantized to int8 per 32 inputs: W8A8-dynamic (llama.cpp's Q8_0 x Q8_0 arithmetic); equals
    cpu_a8.reference to fp32 rounding."""
    grouped, G = _int8_group(qweight, scales, group_size)
    if not INT8_A8_SPEC.fits(x, qweight, grouped, bias, G):
        INT8_A8_SPEC.explain(x, qweight, grouped, bias, G)
    N, K = qweight.shape
    return INT8_A8_SPEC.linear(x, N, K, (x, qweight, grouped, bias), (G,), bias=bias)


def linear_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ (qweight[N, K] * scales)^T + bias -> float32 [..., N]: scales [N] per channel (group_size None)
    or [N, K // group_size] (group_size a multiple of 8: GGUF's Q8_0, Q5_0 and Q6_K blocks)."""
    grouped, G = _int8_group(qweight, scales, group_size)
    if not INT8_SPEC.fits(x, qweight, grouped, bias, G):
        INT8_SPEC.explain(x, qweight, grouped, bias, G)
    N, K = qweight.shape
    return INT8_SPEC.linear(x, N, K, (x, qweight, grouped, bias), (G,), bias=bias)


_DEQ_INT4 = KernelSpec(
    _DEQUANT_INT4,
    "CPU int4 dequantization (AVX2)",
    [Arg("qweight", _U8, ("N", "K/2")), Arg("scales", _F32, ("N", "K/G")), Arg("mins", _F32, ("N", "K/G"))],
    given=("G",),
    rules=(
        Rule(
            ("G", "K"),
            lambda G, K: type(G) is int and G > 0 and G % 2 == 0 and K % G == 0,
            "group_size must be an even positive int dividing K = {K}, not {G!r}",
        ),
    ),
)
_DEQ_INT8 = KernelSpec(
    _DEQUANT_INT8,
    "CPU int8 dequantization (AVX2)",
    [Arg("qweight", _I8, ("N", "K")), Arg("scales", _F32, ("N", "K/G"))],
    given=("G",),
    rules=(Rule(("G", "K"), lambda G, K: type(G) is int and G > 0 and K % G == 0, "bad group_size {G!r}"),),
)


def dequantizes(qweight: torch.Tensor) -> bool:
    """The dequantization kernels run here, for these contiguous CPU codes."""
    return qweight.is_cpu and qweight.is_contiguous() and _DEQUANT_INT4.is_available() and _DEQUANT_INT8.is_available()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K] = q * scales + mins per group (product and sum rounded separately, as the reference does)."""
    if not _DEQ_INT4.fits(qweight, scales, mins, group_size):
        _DEQ_INT4.explain(qweight, scales, mins, group_size)
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    out = torch.empty(N, K, dtype=_F32)
    threads = torch.get_num_threads()
    call(_DEQ_INT4.fn(), _DEQ_INT4.kernel.symbol, qweight, scales, mins, out, N, K, group_size, threads)
    return out


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """float32 [N, K] = int8 codes * scales ([N] per channel, or [N, K / group_size])."""
    grouped, G = _int8_group(qweight, scales, group_size)
    if not _DEQ_INT8.fits(qweight, grouped, G):
        _DEQ_INT8.explain(qweight, grouped, G)
    N, K = qweight.shape
    out = torch.empty(N, K, dtype=_F32)
    call(_DEQ_INT8.fn(), _DEQ_INT8.kernel.symbol, qweight, grouped, out, N, K, G, torch.get_num_threads())
    return out


_INT4_CALL = call_entry(_SOURCE, "leanlm_linear_int4_f32_call", **_AVX2)
_INT8_CALL = call_entry(_SOURCE, "leanlm_linear_int8_f32_call", **_AVX2)
_INT4_A8_CALL = call_entry(_SOURCE, "leanlm_linear_int4_a8_f32_call", **_AVX2)
_INT8_A8_CALL = call_entry(_SOURCE, "leanlm_linear_int8_a8_f32_call", **_AVX2)


def int4_native_call(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    act_int8: bool = False,
) -> NativeCall | None:
    """The float32 decode loop's call of the int4 GEMV (decode_layers_f32.c; `act_int8`: the W4A8 one): codes uint8
    [N, K / 2], scales and mins float32 [N, K / group_size] (or half, with `act_int8`: half_copies), bias float32
    [N] or None; None where they are not what it reads."""
    if act_int8:
        half = int(scales.dtype is torch.float16)
        spec = INT4_A8_HALF_SPEC if half else INT4_A8_SPEC
        if not spec.fits_partial(None, qweight, scales, mins, bias, group_size, half):
            return None
        return NativeCall("int4_a8_f32", _INT4_A8_CALL, (qweight, scales, mins, bias), (group_size, half))
    if not INT4_SPEC.fits_partial(None, qweight, scales, mins, bias, group_size):
        return None
    return NativeCall("int4_f32", _INT4_CALL, (qweight, scales, mins, bias), (group_size,))


def int8_native_call(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int | None,
    act_int8: bool = False,
) -> NativeCall | None:
    """As int4_native_call, for int8 codes [N, K] with scales [N] (per channel) or [N, K / group_size]."""
    grouped, G = _int8_group(qweight, scales, group_size)
    spec = INT8_A8_SPEC if act_int8 else INT8_SPEC
    if not spec.fits_partial(None, qweight, grouped, bias, G):
        return None
    if act_int8:
        return NativeCall("int8_a8_f32", _INT8_A8_CALL, (qweight, grouped, bias), (G,))
    return NativeCall("int8_f32", _INT8_CALL, (qweight, grouped, bias), (G,))
