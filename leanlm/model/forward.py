"""The differentiable forward over whole sequences [B, T], causal attention, no KV cache: what the trainer runs, and
what compression's LKD and TEAL allocation run a decoder layer with (so it lives with the model, below both).

The engine's forward (leanlm.model.llama) reads and writes a paged KV cache inside a forward context and runs
native kernels with no backward; training needs neither. This forward calls the same modules (so the same
parameters, norms, rotary tables and MLP) and replaces only the paged attention by causal SDPA over each
sequence, which is what the paged path computes for a fresh prompt (tests/train/test_forward.py checks the
logits against the engine's).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.model.llama import LlamaAttention, LlamaDecoderLayer


def attention(attn: LlamaAttention, x: torch.Tensor, rope) -> torch.Tensor:
    """Causal self-attention of sequences x [B, T, hidden] -> [B, T, hidden]; rope: cos, sin [T, 1, D/2]. The
    layer's trained window and soft-cap apply as in the paged forward."""
    batch, num_tokens, _ = x.shape
    q, k, v = attn.qkv(x, rope)  # [B, T, H, D], [B, T, Hkv, D]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attn.window is None and attn.softcap is None:
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=attn.scale, enable_gqa=attn.num_kv_heads != attn.num_heads
        )  # [B, H, T, D]
    else:
        out = _masked(attn, q, k, v)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, num_tokens, -1))


def _masked(attn: LlamaAttention, q, k, v) -> torch.Tensor:
    """Attention under the layer's window and soft-cap: q [B, H, T, D], k, v [B, Hkv, T, D] -> [B, H, T, D]."""
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * attn.scale  # [B, H, T, T]
    if attn.softcap is not None:
        scores = torch.tanh(scores / attn.softcap) * attn.softcap
    pos = torch.arange(q.shape[2], device=q.device)
    keep = pos[None, :] <= pos[:, None]
    if attn.window is not None:
        keep &= pos[None, :] > pos[:, None] - attn.window
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")).float(), dim=-1).to(v.dtype)
    return probs @ v


def decoder_layer(layer: LlamaDecoderLayer, x: torch.Tensor, rope) -> torch.Tensor:
    """LlamaDecoderLayer.forward over sequences [B, T, hidden]."""
    return layer.after_attention(x, attention(layer.self_attn, layer.input_layernorm(x), rope))


def residual_stream(model: nn.Module, input_ids: torch.Tensor, num_layers: int | None = None) -> Iterator[torch.Tensor]:
    """input_ids [B, T] -> the residual stream [B, T, hidden] after 0, 1, ..., `num_layers` layers (default all),
    un-normed, one at a time: early-exit training reads every layer's output from this one forward."""
    x = model.model.embed(input_ids)  # [B, T, hidden]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    rope = model.rotary_emb(positions, x.dtype)  # cos, sin [T, 1, D/2]
    yield x
    for layer in model.model.layers[:num_layers]:
        x = decoder_layer(layer, x, rope)
        yield x


def hidden_states(model: nn.Module, input_ids: torch.Tensor, num_layers: int | None = None) -> torch.Tensor:
    """input_ids [B, T] -> final-normed hidden states [B, T, hidden] (after the first `num_layers` layers,
    default all; the final norm applied either way)."""
    last = deque(residual_stream(model, input_ids, num_layers), maxlen=1).pop()  # no list of every layer's output
    return model.model.norm(last)


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T] -> next-token logits [B, T, V]."""
    return model.compute_logits(hidden_states(model, input_ids))


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Mean next-token cross entropy of sequences [B, T] (T - 1 scored tokens each). The head and the loss
    run `chunk` positions at a time under checkpointing, so the [B*T, V] logits never exist at once (49k-way
    float32 logits of 8k tokens would be 1.6 GB, their gradient as much again)."""
    hidden = hidden_states(model, input_ids)[:, :-1].reshape(-1, model.config.hidden_size)  # [N, hidden]
    targets = input_ids[:, 1:].reshape(-1)  # [N]
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        total = total + torch.utils.checkpoint.checkpoint(
            _head_nll_sum, model, hidden[rows], targets[rows], use_reentrant=False
        )
    return total / targets.numel()


def _head_nll_sum(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    scores = model.compute_logits(hidden)  # [n, V]; bf16 under autocast, the loss in float32 (or float64)
    return F.cross_entropy(scores.to(torch.promote_types(scores.dtype, torch.float32)), targets, reduction="sum")
