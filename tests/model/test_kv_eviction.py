"""KV eviction math (H2O, SnapKV, compaction) on tiny tensors against naive loops."""

from __future__ import annotations

import math

import torch

from leanlm.model import kv_eviction
from leanlm.model.kv_quant import store_kv


def _naive_probs(q, keys, scale, first_slot):
    """[Hkv, G, n, S] by loops: query j of head h over the slots <= first_slot + j of its KV head."""
    n, num_heads, _ = q.shape
    num_kv_heads, num_slots, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_kv_heads, group, n, num_slots, dtype=torch.float64)
    for h in range(num_heads):
        kv_head, g = divmod(h, group)
        for j in range(n):
            visible = first_slot + j + 1
            logits = [float(q[j, h].double() @ keys[kv_head, s].double()) * scale for s in range(visible)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            for s in range(visible):
                out[kv_head, g, j, s] = weights[s] / sum(weights)
    return out


def test_slot_rows_address_each_slot_and_head():
    block_ids = torch.tensor([5, 2, 7])
    rows = kv_eviction.slot_rows(block_ids, num_kv_heads=2, block_size=4, num_slots=10)
    for h in range(2):
        for s in range(10):
            assert rows[h, s] == (int(block_ids[s // 4]) * 2 + h) * 4 + s % 4


def test_attention_probs_match_a_naive_softmax():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen)
    keys = torch.randn(2, 9, 8, generator=gen)
    got = kv_eviction.attention_probs(q, keys, 0.35, first_slot=6)
    torch.testing.assert_close(got.double(), _naive_probs(q, keys, 0.35, 6), atol=1e-6, rtol=1e-5)


def test_accumulated_attention_sums_queries_and_group_in_chunks(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(7, 4, 8, generator=gen)
    keys = torch.randn(2, 10, 8, generator=gen)
    monkeypatch.setattr(kv_eviction, "PROBS_CHUNK", 3)  # three chunks: 3 + 3 + 1 queries
    got = kv_eviction.accumulated_attention(q, keys, 0.3, first_slot=3)
    want = _naive_probs(q, keys, 0.3, 3).sum(dim=(1, 2))
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_h2o_keeps_the_recent_half_and_the_heaviest_of_the_rest():
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(3, 20, generator=gen)
    keep = kv_eviction.h2o_keep(scores, budget=8)
    for h in range(3):
        recent = list(range(16, 20))
        older = sorted(range(16), key=lambda s: -float(scores[h, s]))[:4]
        assert keep[h].tolist() == sorted(older + recent)


def test_snapkv_keeps_the_window_and_the_best_pooled_votes():
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(2, 3, 4, 30, generator=gen)  # [Hkv, G, w=4, S=30]
    keep = kv_eviction.snapkv_keep(probs, budget=10)
    half = kv_eviction.SNAPKV_KERNEL // 2
    for h in range(2):
        votes = [float(probs[h, :, :, s].sum()) for s in range(26)]
        pooled = [max(votes[max(0, s - half) : s + half + 1]) for s in range(26)]
        chosen = sorted(range(26), key=lambda s: (-pooled[s], s))[:6]
        kept_pooled = sorted(pooled[s] for s in keep[h, :6].tolist())
        assert kept_pooled == sorted(pooled[s] for s in chosen)  # ties may pick another slot of equal value
        assert keep[h, 6:].tolist() == [26, 27, 28, 29]
        assert keep[h].tolist() == sorted(keep[h].tolist())


def test_compact_moves_exactly_the_chosen_rows_per_head_and_leaves_others_alone():
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(6, 2, 4, 3, generator=gen)  # [N, Hkv, bs, D]
    before = cache.clone()
    ids = torch.tensor([4, 1, 3])  # the sequence's blocks, 10 slots in use
    rows = kv_eviction.slot_rows(ids, 2, 4, 10)
    keep = torch.tensor([[0, 3, 4, 8, 9], [1, 2, 6, 7, 9]])
    kv_eviction.compact(cache, rows, keep)
    flat_before, flat = before.view(-1, 3), cache.view(-1, 3)
    for h in range(2):
        for j in range(5):
            torch.testing.assert_close(flat[rows[h, j]], flat_before[rows[h, keep[h, j]]], rtol=0, atol=0)
    for other in (0, 2, 5):  # blocks of other sequences
        torch.testing.assert_close(cache[other], before[other], rtol=0, atol=0)


def test_gather_keys_dequantizes_an_8bit_cache():
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(3, 2, 4, 8, dtype=torch.int8)
    scales = torch.ones(3, 2, 4)
    k = torch.randn(12, 2, 8, generator=gen)  # tokens 0..11 in blocks 0, 1, 2
    slots = torch.arange(12)
    write = ((slots // 4)[:, None] * 2 + torch.arange(2)) * 4 + (slots % 4)[:, None]
    stored = store_kv(cache, scales, k, write.reshape(-1))
    rows = kv_eviction.slot_rows(torch.tensor([0, 1, 2]), 2, 4, 12)
    keys = kv_eviction.gather_keys(cache, scales, rows)  # [Hkv, S, D]
    torch.testing.assert_close(keys, stored.float().transpose(0, 1), atol=1e-6, rtol=1e-6)
