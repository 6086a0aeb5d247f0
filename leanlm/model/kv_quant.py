"""KV-cache quantization: 8-bit K/V (int8 or fp8) with one float32 absmax scale per (token, KV head).

Scales are computed as each token's K/V is written (dynamic, no calibration), the granularity of llama.cpp's
q8_0 KV cache with the group = one head's D values. int8 is symmetric round-to-nearest; fp8 casts saturated.
"""

from __future__ import annotations

import torch

from leanlm.config import KV_CACHE_DTYPES

# kv_cache_dtype name -> storage dtype (None: the model's own dtype, no scales)
STORAGE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
assert tuple(STORAGE_DTYPES) == KV_CACHE_DTYPES, "config.KV_CACHE_DTYPES and STORAGE_DTYPES must agree"

# largest magnitude each 8-bit format stores: the absmax of a row maps onto it
_QMAX: dict[torch.dtype, float] = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,  # 448
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,  # 57344
}
SCALE_DTYPE = torch.float32
_MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row gets this scale: q = 0, never 0/0


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the paged KV tensor is allocated in for kv_cache_dtype `name`."""
    if name not in STORAGE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; use one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    """True when a cache of this dtype stores scaled 8-bit values (and so has a scale tensor beside it)."""
    return dtype in _QMAX


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (values [..., D] in `dtype`, scales [...] float32) with x ~= values * scales."""
    qmax = _QMAX[dtype]
    x = x.to(torch.float32)
    scales = (x.abs().amax(dim=-1) / qmax).clamp_min_(_MIN_SCALE)  # [...]
    y = x / scales.unsqueeze(-1)  # |y| <= qmax up to rounding
    if dtype == torch.int8:
        values = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:  # clamp first: fp8 casts of out-of-range values are not saturating on every backend
        values = y.clamp_(-qmax, qmax).to(dtype)
    return values, scales


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] 8-bit, scales [...] float32 -> [..., D] in `dtype` (multiplied in float32, one rounding)."""
    return (values.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)


def store_kv(
    cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, write_index: torch.Tensor
) -> torch.Tensor:
    """Write x [T, Hkv, D] into cache [N, Hkv, bs, D] at rows `write_index` [T * Hkv] of its [N * Hkv * bs, D]
    view; an 8-bit cache also gets each row's scale in scales [N, Hkv, bs] (same flat row index).

    Returns x as a later read of the cache sees it ([T, Hkv, D], x's dtype): attention over fresh K/V uses it,
    so a prompt reads the same K/V whether it is prefilled whole, in chunks, or after a prefix-cache hit.
    """
    head_dim = cache.shape[-1]
    rows = x.reshape(-1, head_dim)  # [T * Hkv, D]
    if scales is None:
        cache.view(-1, head_dim).index_copy_(0, write_index, rows.to(cache.dtype))
        return x
    values, row_scales = quantize_kv(rows, cache.dtype)
    # bytes: CPU index_copy_ has no fp8 kernel, and the copy is bitwise anyway
    cache.view(torch.uint8).view(-1, head_dim).index_copy_(0, write_index, values.view(torch.uint8))
    scales.view(-1).index_copy_(0, write_index, row_scales)
    return dequantize_kv(values, row_scales, x.dtype).view_as(x)
