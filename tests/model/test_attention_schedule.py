"""Attention over the paged cache does not depend on the schedule: given the same q/k/v for each token, the cache
holds the same bytes, bit for bit, and every query's output agrees to float rounding, whether its prompt is
prefilled whole, in chunks, beside other requests or decoded in a batch. For an 8-bit cache the bytes matter most:
each token's K/V is quantized into the cache (per token and head, so the bytes depend on that row alone) before
any query reads it, and queries read fresh K/V as stored, so a chunk boundary never changes what a query sees.
SDPA itself rounds by shape (a few ulp between a 5-row and a 30-row call), which the tolerance allows."""

from __future__ import annotations

import pytest
import torch

from leanlm.model.attention import get_backend
from leanlm.model.context import build_forward_context
from leanlm.model.kv_quant import kv_storage_dtype
from leanlm.model.paged_kv import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def _cache(kv_cache_dtype: str, dtype: torch.dtype) -> PagedKVCache:
    storage = kv_storage_dtype(kv_cache_dtype, dtype)
    return PagedKVCache.allocate(1, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, storage, "cpu")


class _Sequence:
    """One request: its q/k/v for every position and its KV blocks in a shared cache."""

    def __init__(self, length: int, first_block: int, seed: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.k = (torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen) * 3).to(dtype)
        self.v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        self.blocks = list(range(first_block, first_block + -(-length // BLOCK_SIZE)))


def _run(schedule: list[list[tuple[_Sequence, int, int]]], kv_cache_dtype: str, dtype: torch.dtype, backend: str):
    """Run steps of (sequence, start, end) spans through the backend; -> {(id(seq), position): output row}."""
    cache = _cache(kv_cache_dtype, dtype)
    k_cache, v_cache, k_scales, v_scales = cache.layer(0)
    attention = get_backend(backend)
    rows = {}
    for step in schedule:
        ctx = build_forward_context(
            [end - start for _, start, end in step],
            [end for _, _, end in step],
            [seq.blocks for seq, _, _ in step],
            cache,
        )
        q, k, v = (torch.cat([getattr(seq, name)[start:end] for seq, start, end in step]) for name in "qkv")
        out = attention.forward(q, k, v, cache.layer(0), HEAD_DIM**-0.5, ctx)
        flat = [(seq, pos) for seq, start, end in step for pos in range(start, end)]
        rows.update({(id(seq), pos): out[i] for i, (seq, pos) in enumerate(flat)})
    stored = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (k_cache, v_cache)]
    return rows, stored + [s for s in (k_scales, v_scales) if s is not None]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(
    "kv_cache_dtype,dtype",
    [
        ("auto", torch.float32),
        ("int8", torch.float32),
        ("fp8_e4m3", torch.float32),
        ("fp8_e5m2", torch.float32),
        ("auto", torch.bfloat16),
        ("int8", torch.bfloat16),
        ("fp8_e4m3", torch.bfloat16),
    ],
)
def test_outputs_do_not_depend_on_chunking_or_batching(kv_cache_dtype, dtype, backend):
    a, b = _Sequence(37, 0, seed=1, dtype=dtype), _Sequence(23, 20, seed=2, dtype=dtype)
    # alone: each prompt whole, then its decodes one at a time
    steps = [
        [[(seq, 0, prompt_len)]] + [[(seq, p, p + 1)] for p in range(prompt_len, len(seq.q))]
        for seq, prompt_len in ((a, 30), (b, 17))
    ]
    alone, stored_a = _run(steps[0] + steps[1], kv_cache_dtype, dtype, backend)  # a, then b, in one cache
    # together: a in chunks of 8 (the last chunk beside b's first), b prefilled in two chunks, then batched decodes
    together, stored_together = _run(
        [
            [(a, 0, 8)],
            [(a, 8, 16)],
            [(a, 16, 24), (b, 0, 9)],
            [(a, 24, 30), (b, 9, 17)],
            *[[(a, 30 + i, 31 + i), (b, 17 + i, 18 + i)] for i in range(6)],
            [(a, 36, 37)],
        ],
        kv_cache_dtype,
        dtype,
        backend,
    )
    for before, after in zip(stored_a, stored_together):
        assert torch.equal(before, after)  # the same cache bytes (and 8-bit scales), bit for bit
    assert alone.keys() == together.keys()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for key, row in alone.items():
        torch.testing.assert_close(row, together[key], **tol)
