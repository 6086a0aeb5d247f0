"""Attention with soft-capped scores, c * tanh(q.k * scale / c) before the softmax (Gemma 2): the paged backends and
the native kernels take plain scores, so a capped layer attends here, request by request over the keys its cache
holds, under its trained window and any runtime pattern but sinks (which rotate the query again)."""

from __future__ import annotations

import torch

from leanlm.model.attention import gather_rows
from leanlm.model.attention_pattern import allowed, layer_pattern
from leanlm.model.context import ForwardContext
from leanlm.model.kv_quant import store_kv
from leanlm.model.paged_kv import LayerKV


def capped_attention(
    q: torch.Tensor,  # [T, H, D] rotated
    k: torch.Tensor,  # [T, Hkv, D] rotated
    v: torch.Tensor,  # [T, Hkv, D]
    kv: LayerKV,
    scale: float,
    ctx: ForwardContext,
    window: int | None,
    q_sink: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:  # [T, H, D]
    if q_sink is not None:
        raise ValueError(
            "attention sinks re-rotate the query, which soft-capped attention (Gemma 2) does not: serve this model "
            "without attention sinks (a window alone is fine)"
        )
    store_kv(kv.k_cache, kv.k_scales, k, ctx.kv_write_index)
    store_kv(kv.v_cache, kv.v_scales, v, ctx.kv_write_index)
    decode, prefill = (
        layer_pattern(ctx.long_inputs.patterns.decode, window),
        layer_pattern(ctx.long_inputs.patterns.prefill, window),
    )
    prompt_starts = {span.token_start for span in ctx.prefills}
    starts = ctx.query_start_loc.tolist()
    out = torch.empty_like(q)
    for b, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        if end == start:
            continue
        seq_len = int(ctx.seq_lens[b])
        keys = gather_rows(kv.k_cache, ctx.block_tables[b], seq_len, kv.k_scales, q.dtype).to(q.dtype)  # [S, Hkv, D]
        values = gather_rows(kv.v_cache, ctx.block_tables[b], seq_len, kv.v_scales, q.dtype).to(q.dtype)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        pattern = prefill if start in prompt_starts else decode
        mask = allowed(q_pos, torch.arange(seq_len, device=q.device), pattern)  # [n, S]
        out[start:end] = _attend(q[start:end], keys, values, mask, scale, softcap)
    return out


def _attend(q, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    """q [n, H, D] over keys / values [S, Hkv, D] where mask [n, S] allows, scores capped; -> [n, H, D]."""
    n, num_heads, head_dim = q.shape
    num_kv = keys.shape[1]
    queries = q.view(n, num_kv, num_heads // num_kv, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    scores = queries @ keys.permute(1, 2, 0)[:, None]  # [Hkv, G, n, S]
    scores = torch.tanh(scores * (scale / softcap)) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = probs @ values.transpose(0, 1)[:, None]  # [Hkv, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
