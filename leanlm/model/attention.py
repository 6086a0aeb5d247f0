"""Paged attention backends behind a small registry.

The reference backend ("torch") runs anywhere PyTorch does: it writes new K/V into the paged cache, then
attends from it with scaled_dot_product_attention, one-token rows (decodes) batched, prompt chunks one by one.
An 8-bit cache (int8/fp8, leanlm.model.kv_quant) comes with per-(token, KV head) scales: quantized on write,
dequantized to the query dtype as blocks are gathered. Under an attention pattern (a layer's trained window, the
runtime window + sinks or prefill pattern of the forward context) rows go to `attend_pattern`: the native kernel with
per-row bounds, or leanlm.model.sparse_attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from leanlm.kernels import paged_attention
from leanlm.model.attention_pattern import layer_pattern
from leanlm.model.context import ForwardContext, PrefillSpan
from leanlm.model.kv_quant import dequantize_kv, store_kv
from leanlm.model.paged_kv import LayerKV
from leanlm.model.sparse_attention import sparse_attention


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] (rotary applied)
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv: LayerKV,  # this layer's paged cache; new K/V are written into it
        scale: float,
        ctx: ForwardContext,
        window: int | None = None,  # the layer's trained sliding window; None: full
        q_sink: torch.Tensor
        | None = None,  # [T, H, D]: q rotated at the re-based sink positions (long_inputs.sink_rope)
    ) -> torch.Tensor:  # [T, H, D]
        ...


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        _BACKENDS[name] = cls
        return cls

    return wrap


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str = "auto") -> AttentionBackend:
    """'auto' = the native CPU kernels where they apply (falling back per call), the reference otherwise."""
    if name == "auto":
        name = "cpu"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]()


@register_backend("torch")
class TorchAttentionBackend:
    """Reference paged attention over PyTorch's SDPA (CPU and CUDA)."""

    name = "torch"

    def forward(self, q, k, v, kv: LayerKV, scale, ctx, window=None, q_sink=None):
        # Store first: every new token's K/V is in the cache before any request of the batch reads it. Fresh
        # K/V are then read as stored (an 8-bit cache's rounding included), like the cached prefix.
        k = store_kv(kv.k_cache, kv.k_scales, k, ctx.kv_write_index)
        v = store_kv(kv.v_cache, kv.v_scales, v, ctx.kv_write_index)
        decode = layer_pattern(ctx.long_inputs.patterns.decode, window)
        prefill = layer_pattern(ctx.long_inputs.patterns.prefill, window)
        if decode is None and prefill is None:
            return self.attend(q, k, v, kv, scale, ctx)
        return self.attend_pattern(q, q_sink, k, v, kv, scale, ctx, decode, prefill)

    def attend_pattern(self, q, q_sink, k, v, kv: LayerKV, scale, ctx: ForwardContext, decode, prefill):
        """Attention of every row under a pattern (decode rows under `decode`, prompt chunks under `prefill`; None:
        every key, as `attend` runs them), one request at a time over the keys its rows read (sparse_attention)."""
        out = torch.empty_like(q)
        if ctx.decode_max_seq_len and decode is None:
            out[ctx.decode_token_idx] = self.decode(q[ctx.decode_token_idx], kv, scale, ctx)
        elif ctx.decode_max_seq_len:
            table, lens = ctx.decode_block_tables, ctx.decode_seq_lens.tolist()
            for i, row in enumerate(ctx.decode_token_idx.tolist()):
                rows = slice(row, row + 1)
                qs = None if q_sink is None else q_sink[rows]
                out[rows] = sparse_attention(q[rows], qs, kv, table[i], lens[i], scale, decode)
        for span in ctx.prefills:
            rows = slice(span.token_start, span.token_end)
            if prefill is None:
                out[rows] = _prefill(q, k, v, kv, scale, span)
            else:
                qs = None if q_sink is None else q_sink[rows]
                out[rows] = sparse_attention(q[rows], qs, kv, span.block_ids, span.seq_len, scale, prefill)
        return out

    def attend(self, q, k, v, kv: LayerKV, scale, ctx: ForwardContext) -> torch.Tensor:
        """Attention of every row once the step's K/V are in the cache (k, v: the new rows, as stored)."""
        if ctx.is_all_decode:  # rows are the decode rows, in order
            return self.decode(q, kv, scale, ctx)
        out = torch.empty_like(q)
        if ctx.decode_max_seq_len:
            out[ctx.decode_token_idx] = self.decode(q[ctx.decode_token_idx], kv, scale, ctx)
        for span in ctx.prefills:
            out[span.token_start : span.token_end] = _prefill(q, k, v, kv, scale, span)
        return out

    def decode(self, q, kv: LayerKV, scale, ctx: ForwardContext) -> torch.Tensor:
        return _decode(q, kv, scale, ctx)


@register_backend("cpu")
class CpuAttentionBackend(TorchAttentionBackend):
    """The reference backend with every row, decodes and prompt tokens, on the native paged kernel (bf16 or int8 KV,
    AVX512-BF16 CPUs)."""

    name = "cpu"

    def attend_pattern(self, q, q_sink, k, v, kv: LayerKV, scale, ctx: ForwardContext, decode, prefill):
        """The kernel reads each row's pattern as (lo, sinks, stride) bounds: only the keys it attends."""
        if not paged_attention.should_use(q, kv.k_cache, kv.k_scales):
            return super().attend_pattern(q, q_sink, k, v, kv, scale, ctx, decode, prefill)
        if ctx.is_all_decode:
            bounds = ctx.decode_bounds(decode)
            tables, seq_lens, max_len = ctx.decode_block_tables, ctx.decode_seq_lens, ctx.decode_max_seq_len
        else:
            bounds = ctx.token_bounds(decode, prefill)
            tables, seq_lens, max_len = ctx.token_rows
        return self._paged(q, kv, scale, tables, seq_lens, max_len, bounds, q_sink)

    def attend(self, q, k, v, kv: LayerKV, scale, ctx: ForwardContext) -> torch.Tensor:
        """Steps with prompt chunks run every token as a row of the decode kernel too: query t reads its request's
        blocks up to its own position, which is causal attention. One call for the whole step, no gathered copy
        of a cached prefix, and each row's bits depend only on its query and the cache, not on how the prompt
        was chunked or batched. At least as fast as the gather + SDPA path at every chunk
        `benchmarks/decode_attention.py` measures (1.2-3.6x, 2048 fresh tokens a tie, on a Zen 4)."""
        if ctx.is_all_decode or not paged_attention.should_use(q, kv.k_cache, kv.k_scales):
            return super().attend(q, k, v, kv, scale, ctx)
        tables, seq_lens, max_len = ctx.token_rows
        return self._paged(q, kv, scale, tables, seq_lens, max_len)

    def decode(self, q, kv: LayerKV, scale, ctx: ForwardContext) -> torch.Tensor:
        if not paged_attention.should_use(q, kv.k_cache, kv.k_scales):  # e.g. fp8 or float32 K/V
            return super().decode(q, kv, scale, ctx)
        return self._paged(q, kv, scale, ctx.decode_block_tables, ctx.decode_seq_lens, ctx.decode_max_seq_len)

    @staticmethod
    def _paged(q, kv: LayerKV, scale, tables, seq_lens, max_len: int, bounds=None, q_sink=None) -> torch.Tensor:
        if kv.k_scales is None:
            return paged_attention.paged_decode_attention(
                q, kv.k_cache, kv.v_cache, tables, seq_lens, max_len, scale, bounds, q_sink
            )
        return paged_attention.paged_decode_attention_int8(
            q, kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales, tables, seq_lens, max_len, scale, bounds, q_sink
        )


def gather_rows(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    length: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first `length` tokens of each block list: cache [N, Hkv, bs, D], block_ids [..., nb] -> [..., L, Hkv, D].

    Whole blocks are copied (index_select: contiguous rows, far cheaper than per-slot indexing), then cut. An
    8-bit cache is dequantized to `dtype` with its scales [N, Hkv, bs] block by block.
    """
    num_kv_heads, block_size, head_dim = cache.shape[1:]
    num_blocks = -(-length // block_size)
    ids = block_ids[..., :num_blocks]
    rows = cache.index_select(0, ids.reshape(-1))  # [prod(...) * nb, Hkv, bs, D]
    if scales is not None:
        rows = dequantize_kv(rows, scales.index_select(0, ids.reshape(-1)), dtype)
    rows = rows.transpose(1, 2)  # [prod(...) * nb, bs, Hkv, D]
    rows = rows.reshape(*ids.shape[:-1], num_blocks * block_size, num_kv_heads, head_dim)
    return rows[..., :length, :, :]


def _decode(q, kv: LayerKV, scale, ctx: ForwardContext) -> torch.Tensor:
    """One query per request: q [Bd, H, D] -> [Bd, H, D], all requests in one SDPA call."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = kv.k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_len = ctx.decode_max_seq_len
    tables = ctx.decode_block_tables
    keys = gather_rows(kv.k_cache, tables, max_len, kv.k_scales, q.dtype).transpose(1, 2)  # [Bd, Hkv, L, D]
    values = gather_rows(kv.v_cache, tables, max_len, kv.v_scales, q.dtype).transpose(1, 2)
    valid = torch.arange(max_len, device=q.device) < ctx.decode_seq_lens.unsqueeze(1)  # [Bd, L]
    mask = torch.zeros(valid.shape, dtype=keys.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
    # The `group` query heads sharing a KV head ride as that head's query rows: no K/V repetition.
    queries = q.view(num_reqs, num_kv_heads, group, head_dim).to(keys.dtype)  # [Bd, Hkv, G, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_reqs, num_heads, head_dim).to(q.dtype)


def _prefill(q, k, v, kv: LayerKV, scale, span: PrefillSpan) -> torch.Tensor:
    """A chunk of n new tokens at the end of a seq_len-token sequence, causal: -> [n, H, D].

    4-D SDPA with GQA and, past a cached prefix, an additive float mask: the shapes that keep PyTorch's CPU
    flash kernel (a boolean or 3-D mask falls back to the math path, 3-4x slower).
    """
    n = span.token_end - span.token_start
    queries = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if span.seq_len == n:  # nothing cached before this chunk: the fresh K/V, plain causal
        keys = k[span.token_start : span.token_end]  # [n, Hkv, D]
        values = v[span.token_start : span.token_end]
        mask = None
    else:
        keys = gather_rows(kv.k_cache, span.block_ids, span.seq_len, kv.k_scales, q.dtype)  # [S, Hkv, D]
        values = gather_rows(kv.v_cache, span.block_ids, span.seq_len, kv.v_scales, q.dtype)
        # query j sits at absolute position seq_len - n + j and sees keys 0 .. seq_len - n + j
        q_pos = torch.arange(span.seq_len - n, span.seq_len, device=q.device)
        allowed = torch.arange(span.seq_len, device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, S]
        mask = torch.zeros(allowed.shape, dtype=queries.dtype, device=q.device)
        mask = mask.masked_fill_(~allowed, float("-inf"))[None, None]  # [1, 1, n, S]
    keys = keys.transpose(0, 1).unsqueeze(0).to(queries.dtype)  # [1, Hkv, S, D]
    values = values.transpose(0, 1).unsqueeze(0).to(queries.dtype)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)  # [n, H, D]
