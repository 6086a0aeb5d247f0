"""KV eviction math: which cached slots a sequence keeps under a budget, and the gather that compacts them.

H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"): attention accumulated over every query so far; keep the heaviest
slots plus the most recent ones, half and half. SnapKV (Li et al. 2024): the attention of the last queries (the
observation window), summed and max-pooled along the keys, picks the older slots to keep; the window itself stays.
Both choose per (layer, KV head), the query heads of a group voting together: the cache is [N, Hkv, bs, D], so each
head's rows are permuted on their own. Keys carry rotary at their true positions, so attention over any subset of
slots is order-free, and a sequence's positions go on counting after an eviction while its slots do not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leanlm.model.kv_quant import dequantize_kv

SNAPKV_WINDOW = 32  # observation window: the paper's 32 last queries
SNAPKV_KERNEL = 7  # max-pool width along the keys, so neighbours of a chosen key come with it
PROBS_CHUNK = 256  # queries per softmax when scoring a long chunk: [Hkv, G, 256, S] float32 at a time


def slot_rows(block_ids: torch.Tensor, num_kv_heads: int, block_size: int, num_slots: int) -> torch.Tensor:
    """[Hkv, S] long: the row of a sequence's slot s, KV head h, in a layer's cache viewed as [N * Hkv * bs, ...];
    block_ids [nb] long holds the sequence's blocks in slot order."""
    slots = torch.arange(num_slots, device=block_ids.device)
    blocks = block_ids[slots // block_size]  # [S]
    heads = torch.arange(num_kv_heads, device=block_ids.device)
    return (blocks[None, :] * num_kv_heads + heads[:, None]) * block_size + (slots % block_size)[None, :]


def gather_keys(cache: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """cache [N, Hkv, bs, D] (scales [N, Hkv, bs] for an 8-bit one), rows [Hkv, S] -> [Hkv, S, D] float32."""
    keys = cache.view(-1, cache.shape[-1])[rows]
    if scales is not None:
        return dequantize_kv(keys, scales.view(-1)[rows], torch.float32)
    return keys.float()


def attention_probs(q: torch.Tensor, keys: torch.Tensor, scale: float, first_slot: int) -> torch.Tensor:
    """Softmax of each query over the slots it sees: q [n, H, D] are the queries of slots first_slot .. first_slot +
    n - 1 (query j sees slots 0 .. first_slot + j; slot order is position order), keys [Hkv, S, D] ->
    [Hkv, G, n, S] float32, G = H / Hkv query heads per KV head."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads, num_slots = keys.shape[:2]
    group = num_heads // num_kv_heads
    queries = q.float().view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    logits = queries @ keys.transpose(1, 2).unsqueeze(1) * scale  # [Hkv, G, n, S]
    limit = torch.arange(first_slot, first_slot + num_queries, device=q.device)
    hidden = torch.arange(num_slots, device=q.device)[None, :] > limit[:, None]  # [n, S]
    return logits.masked_fill_(hidden, float("-inf")).softmax(dim=-1)


def accumulated_attention(q: torch.Tensor, keys: torch.Tensor, scale: float, first_slot: int) -> torch.Tensor:
    """H2O's score increment: the attention each slot receives from the queries q [n, H, D] (see attention_probs),
    summed over the queries and the query heads of its KV head -> [Hkv, S] float32. Long chunks go PROBS_CHUNK
    queries at a time."""
    total = torch.zeros(keys.shape[:2], dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[0], PROBS_CHUNK):
        probs = attention_probs(q[start : start + PROBS_CHUNK], keys, scale, first_slot + start)
        total += probs.sum(dim=(1, 2))
    return total


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, S] -> the k largest's indices per row; ties (max-pooling makes many) go to the earlier slot, on every
    device alike (topk breaks them as its kernel happens to)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def h2o_keep(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """scores [Hkv, S] (accumulated attention, S > budget) -> [Hkv, budget] slots to keep, ascending: the last
    budget // 2 (recent) and the budget - budget // 2 heaviest of the rest (heavy hitters)."""
    num_kv_heads, num_slots = scores.shape
    num_recent = budget // 2
    heavy = _top(scores[:, : num_slots - num_recent], budget - num_recent)
    recent = torch.arange(num_slots - num_recent, num_slots, device=scores.device).expand(num_kv_heads, -1)
    return torch.cat([heavy, recent], dim=-1).sort(dim=-1).values


def snapkv_keep(window_probs: torch.Tensor, budget: int) -> torch.Tensor:
    """window_probs [Hkv, G, w, S]: the attention of the last w queries (those of the last w slots, S > budget > w)
    -> [Hkv, budget] slots to keep, ascending: the w window slots and the budget - w older slots whose summed
    attention, max-pooled over SNAPKV_KERNEL neighbours, is largest."""
    num_kv_heads, _, window, num_slots = window_probs.shape
    votes = window_probs.sum(dim=(1, 2))[:, : num_slots - window]  # [Hkv, S - w]
    pooled = F.max_pool1d(votes.unsqueeze(1), SNAPKV_KERNEL, stride=1, padding=SNAPKV_KERNEL // 2).squeeze(1)
    chosen = _top(pooled, budget - window)
    recent = torch.arange(num_slots - window, num_slots, device=window_probs.device).expand(num_kv_heads, -1)
    return torch.cat([chosen, recent], dim=-1).sort(dim=-1).values


def compact(cache: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """Move the kept slots of one sequence to its first slots, in place, per KV head: cache [N, Hkv, bs, ...] (a
    layer's keys, values or 8-bit scales), rows [Hkv, S] its slots' rows (slot_rows), keep [Hkv, K] ascending slot
    indices. Afterwards slot j of head h holds what slot keep[h, j] held; slots K.. are free."""
    flat = cache.view(-1, *cache.shape[3:])
    src = rows.gather(1, keep).reshape(-1)
    dst = rows[:, : keep.shape[1]].reshape(-1)
    flat[dst] = flat[src]  # the read is a copy: sources that are also destinations are read first
