"""Attention over the paged cache does not depend on the schedule: given the same q/k/v for each token, the cache
holds the same bytes, bit for bit, and every query's output agrees to float rounding, whether its prompt is
prefilled whole, in chunks, beside other requests or decoded in a batch. For an 8-bit cache the bytes matter most:
each token's K/V is quantized into the cache (per token and head, so the bytes depend on that row alone) before
any query reads it, and queries read fresh K/V as stored, so a chunk boundary never changes what a query sees.
SDPA itself rounds by shape (a few ulp between a 5-row and a 30-row call), which the tolerance allows."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import paged_attention
from leanlm.model.attention import get_backend
from leanlm.model.context import build_forward_context
from leanlm.model.kv_quant import kv_storage_dtype
from leanlm.model.paged_kv import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def _cache(kv_cache_dtype: str, dtype: torch.dtype, head_dim: int = HEAD_DIM) -> PagedKVCache:
    storage = kv_storage_dtype(kv_cache_dtype, dtype)
    return PagedKVCache.allocate(1, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, head_dim, storage, "cpu")


class _Sequence:
    """One request: its q/k/v for every position and its KV blocks in a shared cache."""

    def __init__(self, length: int, first_block: int, seed: int, dtype: torch.dtype, head_dim: int = HEAD_DIM) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, NUM_HEADS, head_dim, generator=gen).to(dtype)
        self.k = (torch.randn(length, NUM_KV_HEADS, head_dim, generator=gen) * 3).to(dtype)
        self.v = torch.randn(length, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        self.blocks = list(range(first_block, first_block + -(-length // BLOCK_SIZE)))


def _run(schedule: list[list[tuple[_Sequence, int, int]]], kv_cache_dtype: str, dtype: torch.dtype, backend: str):
    """Run steps of (sequence, start, end) spans through the backend; -> {(id(seq), position): output row}."""
    head_dim = schedule[0][0][0].q.shape[-1]
    cache = _cache(kv_cache_dtype, dtype, head_dim)
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
        out = attention.forward(q, k, v, cache.layer(0), head_dim**-0.5, ctx)
        flat = [(seq, pos) for seq, start, end in step for pos in range(start, end)]
        rows.update({(id(seq), pos): out[i] for i, (seq, pos) in enumerate(flat)})
    stored = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (k_cache, v_cache)]
    return rows, stored + [s for s in (k_scales, v_scales) if s is not None]


def _alone(a: _Sequence, b: _Sequence) -> list:
    """Each prompt whole (a: 30 tokens, b: 17), then its decodes one at a time; a, then b, in one cache."""
    return [
        step
        for seq, prompt_len in ((a, 30), (b, 17))
        for step in [[(seq, 0, prompt_len)]] + [[(seq, p, p + 1)] for p in range(prompt_len, len(seq.q))]
    ]


def _together(a: _Sequence, b: _Sequence) -> list:
    """a in chunks of 8 (the last chunk beside b's first), b prefilled in two chunks, then batched decodes."""
    return [
        [(a, 0, 8)],
        [(a, 8, 16)],
        [(a, 16, 24), (b, 0, 9)],
        [(a, 24, 30), (b, 9, 17)],
        *[[(a, 30 + i, 31 + i), (b, 17 + i, 18 + i)] for i in range(6)],
        [(a, 36, 37)],
    ]


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
    alone, stored_a = _run(_alone(a, b), kv_cache_dtype, dtype, backend)
    together, stored_together = _run(_together(a, b), kv_cache_dtype, dtype, backend)
    for before, after in zip(stored_a, stored_together):
        assert torch.equal(before, after)  # the same cache bytes (and 8-bit scales), bit for bit
    assert alone.keys() == together.keys()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for key, row in alone.items():
        torch.testing.assert_close(row, together[key], **tol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cpu_kernel_rows_are_schedule_free_bit_for_bit_and_match_sdpa(kv_cache_dtype):
    """With the native kernel (head dim 64), prompt chunks run as rows of the decode kernel: every output row is
    the same bits however its prompt was chunked or batched, and agrees with the gather + SDPA reference."""
    cache = _cache(kv_cache_dtype, torch.bfloat16, 64).layer(0)
    q = torch.zeros(1, NUM_HEADS, 64, dtype=torch.bfloat16)
    if not paged_attention.should_use(q, cache.k_cache, cache.k_scales):
        pytest.skip("the paged attention kernel is not available on this CPU")
    a, b = (_Sequence(n, first, seed, torch.bfloat16, 64) for n, first, seed in ((37, 0, 1), (23, 20, 2)))
    alone, _ = _run(_alone(a, b), kv_cache_dtype, torch.bfloat16, "cpu")
    together, _ = _run(_together(a, b), kv_cache_dtype, torch.bfloat16, "cpu")
    reference, _ = _run(_together(a, b), kv_cache_dtype, torch.bfloat16, "torch")
    for key, row in alone.items():
        assert torch.equal(row, together[key]), key
        # the reference rounds int8 K/V, dequantized, to bf16; the kernel scales them in float32
        tol = 1e-2 if kv_cache_dtype == "auto" else 3e-2
        torch.testing.assert_close(row, reference[key], rtol=tol, atol=tol)
