"""GGUF's K-quant super-blocks at the AVX2 level: few-row GEMVs with int8 activations (float32 models) over Q4_K's
and Q6_K's own bit widths (gemv_kquant_avx2.c), where the layers that hold them (IntGroupWeightOnlyLinear in groups
of 32, Int8WeightOnlyLinear in groups of 16) would otherwise read 6 and 10 bits a weight.

A layer keeps its codes and float32 scales (what checkpoints save and shards cut); this module derives the
kernel's compact copy from them where it is exact: each super-block of 256 weights' scales factor as one float
times small integers (Q4_K: d * 6-bit scale, -dmin * 6-bit min; Q6_K: d * int8 scale), which is how llama.cpp
quantized them, so the factors are found by dividing the block's largest scale by the integer its quantizer gives
it (63, or -128 for Q6_K) and checking every product bit for bit. Layers whose scales do not factor (GPTQ, RTN)
get None and keep their other paths.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeCall, call_entry
from leanlm.kernels.spec import ROWS, Arg, KernelSpec, Rule

_SOURCE = Path(__file__).with_name("gemv_kquant_avx2.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_AVX2 = {"cpu_needs": (), "level": "avx2"}
_INT4K = NativeKernel(_SOURCE, "leanlm_linear_int4k_a8_f32", [_P] * 8 + [_I64] * 3 + [_INT, _I64], _INT, **_AVX2)
_INT6 = NativeKernel(_SOURCE, "leanlm_linear_int6_a8_f32", [_P] * 7 + [_I64] * 3 + [_INT, _I64], _INT, **_AVX2)
_INT4K_CALL = call_entry(_SOURCE, "leanlm_linear_int4k_a8_f32_call", **_AVX2)
_INT6_CALL = call_entry(_SOURCE, "leanlm_linear_int6_a8_f32_call", **_AVX2)
SUPER = 256  # weights per super-block
MAX_ROWS = 64  # as cpu_qgemv_avx2.MAX_ROWS_A8: beyond, dequantize + sgemm
Q4_K_SCALE, Q4_K_MIN = (63,), (63,)  # the integer the quantizer gives a super-block's largest scale (and min)
Q6_K_SCALE = (-128, 127, -127)  # Q6_K: d = -max / 128, so the largest |scale| is -128 (127 where clipped)
_F32, _U8, _I8 = torch.float32, torch.uint8, torch.int8


def is_available() -> bool:
    """Both K-quant GEMVs are built and loaded (x86-64 Linux, AVX2 + FMA, a C compiler, the level allowed)."""
    return _INT4K.is_available() and _INT6.is_available()


def _k_ok(K: int) -> bool:
    return K % SUPER == 0


_X, _BIAS = Arg("x", _F32, (ROWS, "K")), Arg("bias", _F32, ("N",), optional=True)
_K_RULE = Rule(("K",), _k_ok, "K-quant super-blocks need K % 256 == 0, not K = {K}")
INT4K_SPEC = KernelSpec(
    _INT4K,
    "CPU Q4_K GEMV kernel with int8 activations (AVX2)",
    [
        _X,
        Arg("qweight", _U8, ("N", "K/2")),
        Arg("sc", _U8, ("N", "K/32")),
        Arg("sd", _F32, ("N", "K/256")),
        Arg("mc", _U8, ("N", "K/32")),
        Arg("md", _F32, ("N", "K/256")),
        _BIAS,
    ],
    rules=(_K_RULE,),
    out_dtype=_F32,
)
INT6_SPEC = KernelSpec(
    _INT6,
    "CPU Q6_K GEMV kernel with int8 activations (AVX2)",
    [
        _X,
        Arg("ql", _U8, ("N", "K/2")),
        Arg("qh", _U8, ("N", "K/4")),
        Arg("sc", _I8, ("N", "K/16")),
        Arg("d", _F32, ("N", "K/256")),
        _BIAS,
    ],
    rules=(_K_RULE,),
    out_dtype=_F32,
)


@dataclass(frozen=True)
class SuperScales:
    """An int4 layer's scales and mins [N, K / 32] as sd[s] * sc[g] and md[s] * mc[g] (s = g / 8), exactly."""

    sc: torch.Tensor  # [N, K / 32] uint8
    sd: torch.Tensor  # [N, K / 256] float32
    mc: torch.Tensor  # [N, K / 32] uint8
    md: torch.Tensor  # [N, K / 256] float32


@dataclass(frozen=True)
class SixBit:
    """An int8 layer's codes (-32..31) and scales per 16 in Q6_K's widths: the layout gemv_kquant_avx2.c reads."""

    ql: torch.Tensor  # [N, K / 2] uint8: low 4 bits of code + 32, two 32-code runs per 32 bytes
    qh: torch.Tensor  # [N, K / 4] uint8: high 2 bits, four 32-code runs per 32 bytes
    sc: torch.Tensor  # [N, K / 16] int8
    d: torch.Tensor  # [N, K / 256] float32


def factor_blocks(values: torch.Tensor, per: int, lo: int, hi: int, candidates: tuple[int, ...]):
    """values [N, G] (float32) as d [N, G / per] times integer codes [N, G] in [lo, hi] (int16), exactly, or None.
    Per block, d = (its largest |value|) / c for the first c of `candidates` under which every value of the block
    is an integer multiple of d in range; an all-zero block is d = 0."""
    n, g = values.shape
    if g % per:
        return None
    v = values.reshape(n, g // per, per)
    top = v.gather(-1, v.abs().argmax(-1, keepdim=True))  # [N, S, 1]: signed
    d = torch.zeros_like(top)
    codes = torch.zeros(v.shape, dtype=torch.int16)
    todo = top[..., 0] != 0  # [N, S]
    for c in candidates:
        if not todo.any():
            break
        vt, dt = v[todo], top[todo] / c  # [B, per], [B, 1]
        q = torch.round(vt / dt)
        ok = ((q >= lo) & (q <= hi) & (q * dt == vt)).all(-1)  # [B]
        where = todo.nonzero()[ok]
        d[where[:, 0], where[:, 1]] = dt[ok]
        codes[where[:, 0], where[:, 1]] = q[ok].to(torch.int16)
        todo[where[:, 0], where[:, 1]] = False
    if todo.any():
        return None
    return codes.reshape(n, g), d.reshape(n, g // per)


def super_scales(scales: torch.Tensor, mins: torch.Tensor) -> SuperScales | None:
    """A 4-bit layer's float32 scales and mins [N, K / 32] as Q4_K's super-block factors, or None where they do not
    factor (or K is not whole super-blocks, or the kernel is not loaded)."""
    if not (_INT4K.is_available() and scales.is_cpu and (scales.shape[-1] * 32) % SUPER == 0):
        return None
    s = factor_blocks(scales, SUPER // 32, 0, 255, Q4_K_SCALE)
    m = None if s is None else factor_blocks(mins, SUPER // 32, 0, 255, Q4_K_MIN)
    if m is None:
        return None
    return SuperScales(s[0].to(_U8), s[1].contiguous(), m[0].to(_U8), m[1].contiguous())


def six_bit_copy(qweight: torch.Tensor, scales: torch.Tensor) -> SixBit | None:
    """An int8 layer's codes [N, K] and scales per 16 [N, K / 16] in Q6_K's widths, or None where the codes are
    outside -32..31, the scales do not factor, K is not whole super-blocks or the kernel is not loaded."""
    n, k = qweight.shape
    if not (_INT6.is_available() and qweight.is_cpu and k % SUPER == 0 and scales.shape == (n, k // 16)):
        return None
    if qweight.numel() and (int(qweight.min()) < -32 or int(qweight.max()) > 31):
        return None
    f = factor_blocks(scales, SUPER // 16, -128, 127, Q6_K_SCALE)
    if f is None:
        return None
    u = (qweight.to(torch.int16) + 32).to(_U8).view(n, k // 64, 64)  # [N, P, 64] 0..63
    ql = (u[..., :32] & 0x0F) | ((u[..., 32:] & 0x0F) << 4)  # [N, P, 32]
    high = (u >> 4).view(n, k // 128, 4, 32)  # [N, K / 128, 4 runs, 32]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [N, K / 128, 32]
    ql, qh = ql.reshape(n, k // 2).contiguous(), qh.reshape(n, k // 4).contiguous()
    return SixBit(ql, qh, f[0].to(_I8), f[1].contiguous())


def _rows_ok(x: torch.Tensor) -> bool:
    return x.numel() <= MAX_ROWS * x.shape[-1]


def should_use_int4k(x: torch.Tensor, qweight: torch.Tensor, s: SuperScales | None, bias) -> bool:
    """Policy: at most MAX_ROWS float32 rows, super-block factors, the kernel loaded."""
    return s is not None and _rows_ok(x) and INT4K_SPEC.fits(x, qweight, s.sc, s.sd, s.mc, s.md, bias)


def linear_int4k_a8(x: torch.Tensor, qweight: torch.Tensor, s: SuperScales, bias: torch.Tensor | None = None):
    """x [..., K] float32 @ w^T + bias -> float32 [..., N] with x quantized to int8 per 32 (act_int8.quantize_act_int8)
    and w = q * sd * sc + md * mc per group of 32 (codes as pack_int4 lays them): cpu_a8.reference to fp32 rounding."""
    if not INT4K_SPEC.fits(x, qweight, s.sc, s.sd, s.mc, s.md, bias):
        INT4K_SPEC.explain(x, qweight, s.sc, s.sd, s.mc, s.md, bias)
    N, K = qweight.shape[0], 2 * qweight.shape[1]
    return INT4K_SPEC.linear(x, N, K, (x, qweight, s.sc, s.sd, s.mc, s.md, bias), bias=bias)


def should_use_int6(x: torch.Tensor, six: SixBit | None, bias) -> bool:
    return six is not None and _rows_ok(x) and INT6_SPEC.fits(x, six.ql, six.qh, six.sc, six.d, bias)


def linear_int6_a8(x: torch.Tensor, six: SixBit, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As linear_int4k_a8 for Q6_K's widths: w = (u - 32) * d * sc per 16 (six_bit_copy)."""
    if not INT6_SPEC.fits(x, six.ql, six.qh, six.sc, six.d, bias):
        INT6_SPEC.explain(x, six.ql, six.qh, six.sc, six.d, bias)
    N, K = six.ql.shape[0], 2 * six.ql.shape[1]
    return INT6_SPEC.linear(x, N, K, (x, six.ql, six.qh, six.sc, six.d, bias), bias=bias)


def int4k_native_call(qweight: torch.Tensor, s: SuperScales, bias: torch.Tensor | None) -> NativeCall | None:
    """The float32 decode loop's call of the Q4_K GEMV; None where the tensors are not what it reads."""
    if not INT4K_SPEC.fits_partial(None, qweight, s.sc, s.sd, s.mc, s.md, bias):
        return None
    return NativeCall("int4k_a8_f32", _INT4K_CALL, (qweight, s.sc, s.sd, s.mc, s.md, bias), owner=s)


def int6_native_call(six: SixBit, bias: torch.Tensor | None) -> NativeCall | None:
    """The float32 decode loop's call of the Q6_K GEMV."""
    if not INT6_SPEC.fits_partial(None, six.ql, six.qh, six.sc, six.d, bias):
        return None
    return NativeCall("int6_a8_f32", _INT6_CALL, (six.ql, six.qh, six.sc, six.d, bias), owner=six)
