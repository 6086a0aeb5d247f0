"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; V3): the paged cache holds one row per token, the
normed KV latent c (kv_lora_rank) and the rotated key slice every head shares (qk_rope_head_dim), split over the
cache's K and V slots. A prompt chunk expands its request's latents through kv_b_proj into per-head keys and values
(what HF computes, and what feeds kv_b_proj's calibration); a decode row attends in the latent space instead, with
kv_b_proj absorbed into the query and the output (q W_UK . c, then W_UV (p . c)): the same numbers, without
expanding the whole cached sequence for one token."""

from __future__ import annotations

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.model.attention import gather_rows
from leanlm.model.attention_pattern import allowed
from leanlm.model.context import ForwardContext, get_forward_context
from leanlm.model.kv_quant import store_kv
from leanlm.model.layers import Linear, RMSNorm, apply_rotary


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] pairs (x0, y0, x1, y1, ...) -> (x0, x1, ..., y0, y1, ...): DeepSeek's rotary layout as the
    rotate-half one (q and k both: their dot product is unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """MLA with HF's DeepseekV2/V3 module names: q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        mla, hidden = config.mla, config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_attention_heads  # after expansion every head has its own key
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rank = mla.kv_lora_rank
        self.head_dim = mla.qk_head_dim
        self.interleaved = mla.rope_interleave
        self.scale = config.attention_scale
        self.window, self.softcap = None, None  # no trained window or cap in any MLA model
        q_out = self.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_width, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=config.attention_bias)

    def _queries(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> q_nope [..., H, nope], q_rot [..., H, R] (rotated)."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(*x.shape[:-1], self.num_heads, self.head_dim).split((self.nope, self.rope_dim), -1)
        return q_nope, apply_rotary(self._layout(q_rot), *rope)

    def latent(self, x: torch.Tensor, rope) -> torch.Tensor:
        """x [..., hidden] -> the cache row [..., kv_lora_rank + R]: the normed latent, then the rotated shared key."""
        c, k_rot = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope_dim), -1)
        k_rot = apply_rotary(self._layout(k_rot).unsqueeze(-2), *rope).squeeze(-2)
        return torch.cat((self.kv_a_layernorm(c), k_rot), dim=-1)

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return deinterleave(x) if self.interleaved else x

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [..., S, W] -> keys [..., S, H, qk_head_dim] and values [..., S, H, v_head_dim]."""
        c, k_rot = rows.split((self.rank, self.rope_dim), -1)
        kv = self.kv_b_proj(c).view(*c.shape[:-1], self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), -1)
        return torch.cat((k_nope, k_rot.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)), -1), v

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequences x [B, T, hidden] -> q, k [B, T, H, qk_head_dim], v [B, T, H, v_head_dim] (the training forward)."""
        q_nope, q_rot = self._queries(x, rope)
        k, v = self.expand(self.latent(x, rope))
        return torch.cat((q_nope, q_rot), -1), k, v

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        ctx = get_forward_context()
        if ctx.long_inputs.sink_rope is not None:
            raise ValueError("attention sinks re-rotate queries, which MLA's shared rotary key does not support")
        q_nope, q_rot = self._queries(x, rope)  # [T, H, nope], [T, H, R]
        rows = self.store(self.latent(x, rope), ctx)  # [T, W] as stored
        out = torch.empty(x.shape[0], self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
        spans = {span.token_start: span for span in ctx.prefills}
        # Prompts with nothing cached before them expand the step's own rows, all in one kv_b_proj call over the
        # step's tokens (the rows calibration observes kv_b_proj on); a chunk after a cached prefix expands its
        # request's cached rows; a decode row attends in latent space.
        step_kv = self.expand(rows) if any(s.seq_len == s.token_end - s.token_start for s in ctx.prefills) else None
        absorbed = None  # kv_b_proj's weight, read once per forward when a decode row needs it
        starts = ctx.query_start_loc.tolist()
        for b, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            if end == start:
                continue
            seq_len, span = int(ctx.seq_lens[b]), spans.get(start)
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=x.device)
            pattern = ctx.long_inputs.patterns.decode if span is None else ctx.long_inputs.patterns.prefill
            mask = allowed(q_pos, torch.arange(seq_len, device=x.device), pattern)  # [n, S]
            if span is not None and seq_len == end - start:
                keys, values = step_kv[0][start:end], step_kv[1][start:end]
                out[start:end] = self._expanded(q_nope[start:end], q_rot[start:end], keys, values, mask)
            elif span is not None:
                keys, values = self.expand(self.cached_rows(ctx, b, seq_len, x.dtype))
                out[start:end] = self._expanded(q_nope[start:end], q_rot[start:end], keys, values, mask)
            else:
                absorbed = self._weight() if absorbed is None else absorbed
                rows_b = self.cached_rows(ctx, b, seq_len, x.dtype)  # [S, W]
                out[start:end] = self._absorbed(q_nope[start:end], q_rot[start:end], rows_b, mask, absorbed)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim))

    def store(self, rows: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step's cache rows [T, W] into this layer's K slot (first half) and V slot (second half); -> the rows
        as stored (an 8-bit cache's rounding included), which every attention then reads."""
        kv, half = ctx.kv_cache.layer(self.layer_idx), rows.shape[-1] // 2
        first = store_kv(kv.k_cache, kv.k_scales, rows[:, None, :half], ctx.kv_write_index)
        second = store_kv(kv.v_cache, kv.v_scales, rows[:, None, half:], ctx.kv_write_index)
        return torch.cat((first, second), dim=-1)[:, 0].to(rows.dtype)

    def cached_rows(self, ctx: ForwardContext, b: int, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        """Request b's first seq_len cache rows [S, W]."""
        kv, table = ctx.kv_cache.layer(self.layer_idx), ctx.block_tables[b]
        slots = ((kv.k_cache, kv.k_scales), (kv.v_cache, kv.v_scales))
        halves = [gather_rows(cache, table, seq_len, scales, dtype).to(dtype) for cache, scales in slots]
        return torch.cat(halves, dim=-1)[:, 0]

    def write_kv(self, x: torch.Tensor, rope) -> None:
        """CALM's state propagation: the cache rows of normed inputs x [T, hidden], attending to nothing."""
        self.store(self.latent(x, rope), get_forward_context())

    def _expanded(self, q_nope, q_rot, k, v, mask) -> torch.Tensor:
        """q [n, H, .] over expanded keys [S, H, qk] and values [S, H, v] -> [n, H, v]."""
        q = torch.cat((q_nope, q_rot), -1)
        scores = torch.einsum("nhd,shd->hns", q, k) * self.scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), -1).to(v.dtype)
        return torch.einsum("hns,shv->nhv", probs, v)

    def _weight(self) -> torch.Tensor:
        """kv_b_proj's weight [H, nope + v, kv_lora_rank] in float32 (any runtime format, dequantized)."""
        return self.kv_b_proj.dequantized_weight().view(self.num_heads, self.nope + self.v_dim, self.rank)

    def _absorbed(self, q_nope, q_rot, rows, mask, weight) -> torch.Tensor:
        """The latent form: q_nope W_UK scores against c, the output W_UV (p . c); [n, H, v]."""
        c, k_rot = rows.split((self.rank, self.rope_dim), -1)  # [S, L], [S, R]
        w = weight.to(c.dtype)
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w[:, : self.nope])  # [n, H, L]
        scores = torch.einsum("nhl,sl->hns", q_latent, c) + torch.einsum("nhr,sr->hns", q_rot, k_rot)
        probs = torch.softmax((scores * self.scale).masked_fill(~mask, float("-inf")).float(), -1).to(c.dtype)
        out_latent = torch.einsum("hns,sl->nhl", probs, c)  # [n, H, L]
        return torch.einsum("nhl,hvl->nhv", out_latent, w[:, self.nope :])
