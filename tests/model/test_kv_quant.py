"""Per-(token, KV head) 8-bit KV quantization: round-trip error bounds, zero rows, outlier heads, cache writes."""

from __future__ import annotations

import pytest
import torch

from leanlm.config import KV_CACHE_DTYPES, EngineConfig
from leanlm.model.kv_quant import (
    STORAGE_DTYPES,
    dequantize_kv,
    is_quantized,
    kv_storage_dtype,
    quantize_kv,
    store_kv,
)

QUANTIZED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _kv(seed: int = 0) -> torch.Tensor:
    """[T=64, Hkv=4, D=64] rows like real K/V: head 2 is a 50x outlier head, token 5 is all zeros in every head."""
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(seed))
    x[:, 2] *= 50.0
    x[:, 1, 3] = 30.0  # one outlier channel in head 1
    x[5] = 0.0
    return x


def test_int8_round_trip_is_within_half_a_step_per_row():
    x = _kv()
    values, scales = quantize_kv(x, torch.int8)
    assert values.dtype == torch.int8 and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]  # one scale per (token, head)
    torch.testing.assert_close(
        scales, (x.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny), rtol=1e-6, atol=0
    )
    assert values.abs().max() == 127  # absmax maps onto the full range
    error = (dequantize_kv(values, scales, torch.float32) - x).abs()
    assert torch.all(error <= scales.unsqueeze(-1) * (0.5 + 1e-5))  # round to nearest: at most half a step


@pytest.mark.parametrize(
    "dtype,mantissa_bits,min_normal_exp",
    [
        (torch.float8_e4m3fn, 3, -6),
        (torch.float8_e5m2, 2, -14),
    ],
)
def test_fp8_round_trip_has_the_format_relative_error(dtype, mantissa_bits, min_normal_exp):
    x = _kv(1)
    values, scales = quantize_kv(x, dtype)
    assert values.dtype == dtype and not torch.isnan(values.float()).any()
    assert values.float().abs().amax(-1)[scales > 1e-30].eq(torch.finfo(dtype).max).all()  # saturates at absmax
    error = (dequantize_kv(values, scales, torch.float32) - x).abs()
    # normal numbers: half an ulp, 2^-(m+1) relative; subnormals: half the smallest spacing, absolute
    bound = x.abs() * 2.0 ** -(mantissa_bits + 1) + scales.unsqueeze(-1) * 2.0 ** (min_normal_exp - mantissa_bits - 1)
    assert torch.all(error <= bound * (1 + 1e-5))


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_zero_rows_and_outlier_heads(dtype):
    x = _kv(2)
    values, scales = quantize_kv(x, dtype)
    out = dequantize_kv(values, scales, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert torch.equal(out[5], torch.zeros_like(out[5]))  # a zero row comes back as zeros, not NaN
    # Per-head scales: the 50x head does not cost the ordinary heads their precision (SQNR per head, dB).
    for head in range(4):
        signal = x[:, head].pow(2).sum()
        noise = (out[:, head].float() - x[:, head]).pow(2).sum()
        sqnr = 10 * torch.log10(signal / noise)
        assert sqnr > (30 if dtype == torch.int8 else 28 if dtype == torch.float8_e4m3fn else 22), (head, sqnr)


def test_store_kv_writes_values_and_scales_at_the_write_index():
    cache = torch.zeros(4, 2, 3, 8, dtype=torch.float8_e4m3fn)  # [N, Hkv, bs, D]
    scales = torch.ones(4, 2, 3)
    x = torch.randn(2, 2, 8)  # two tokens: slot (block 3, offset 1) and (block 0, offset 2)
    index = torch.tensor([(3 * 2 + h) * 3 + 1 for h in range(2)] + [(0 * 2 + h) * 3 + 2 for h in range(2)])
    read_back = store_kv(cache, scales, x, index)
    expected_values, expected_scales = quantize_kv(x, torch.float8_e4m3fn)
    assert torch.equal(cache[3, :, 1].view(torch.uint8), expected_values[0].view(torch.uint8))
    assert torch.equal(cache[0, :, 2].view(torch.uint8), expected_values[1].view(torch.uint8))
    assert torch.equal(scales[3, :, 1], expected_scales[0]) and torch.equal(scales[0, :, 2], expected_scales[1])
    untouched = torch.ones_like(scales, dtype=torch.bool)
    untouched[3, :, 1] = untouched[0, :, 2] = False
    assert torch.all(scales[untouched] == 1) and not torch.any(cache.view(torch.uint8)[untouched])  # nothing else
    # what store_kv hands back is what a read of the cache gives
    torch.testing.assert_close(read_back[0], dequantize_kv(cache[3, :, 1], scales[3, :, 1], torch.float32))
    plain = torch.zeros(4, 2, 3, 8)
    assert store_kv(plain, None, x, index) is x and torch.equal(plain[3, :, 1], x[0])


def test_kv_cache_dtype_names():
    assert tuple(STORAGE_DTYPES) == KV_CACHE_DTYPES
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("int8", torch.bfloat16) == torch.int8
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert not is_quantized(torch.bfloat16) and all(is_quantized(d) for d in QUANTIZED)
    for name in KV_CACHE_DTYPES:
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'.*auto, int8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="use one of"):
        kv_storage_dtype("fp8", torch.bfloat16)
