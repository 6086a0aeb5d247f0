"""Attention of one request's queries over the cached keys an AttentionPattern lets them read, in PyTorch (any
device): the reference the native kernel is tested against, and the path on GPUs.

Queries go in chunks of QUERY_CHUNK; each chunk gathers only the keys some query of it reads (the sinks and the
window span of the chunk; a strided pattern reads the whole prefix, masked), so a windowed prefill costs
O(n * (window + chunk)) rather than O(n^2), on SDPA's kernels. Re-based sinks need two queries per row (the sink
columns scored with q_sink), which SDPA cannot take: those chunks run as explicit matmuls and a softmax.

On a GPU a prompt chunk runs instead as one compiled flex_attention call (FlexAttention, Dong et al. 2024) with a
BlockMask built from the pattern: the 128 x 128 tiles the pattern leaves empty are skipped, the others masked
element-wise inside the fused kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from leanlm.model.attention_pattern import AttentionPattern, allowed, is_sink
from leanlm.model.kv_quant import dequantize_kv
from leanlm.model.paged_kv import LayerKV

QUERY_CHUNK = 256
FLEX_MIN_QUERIES = 128  # a prompt chunk this long runs on flex_attention on a GPU: one tile row at least


def key_positions(first_query: int, end: int, pattern: AttentionPattern | None, device) -> torch.Tensor:
    """[L] long: the keys that queries first_query .. end - 1 read between them, ascending."""
    if pattern is None or pattern.window is None or pattern.stride:
        return torch.arange(end, device=device)
    lo = max(0, first_query + 1 - pattern.window)
    sinks = torch.arange(min(pattern.sinks, lo), device=device)
    return torch.cat((sinks, torch.arange(lo, end, device=device)))


def gather_positions(
    kv: LayerKV, block_ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [L, Hkv, D] (in `dtype`) of one request's tokens at `positions` [L], through its block ids."""
    block_size = kv.k_cache.shape[2]
    blocks, offsets = block_ids[positions // block_size], positions % block_size
    keys, values = kv.k_cache[blocks, :, offsets], kv.v_cache[blocks, :, offsets]  # [L, Hkv, D]
    if kv.k_scales is not None:
        keys = dequantize_kv(keys, kv.k_scales[blocks, :, offsets], dtype)
        values = dequantize_kv(values, kv.v_scales[blocks, :, offsets], dtype)
    return keys.to(dtype), values.to(dtype)


def sparse_attention(
    q: torch.Tensor,  # [n, H, D]: the last n tokens of a seq_len-token sequence, rotary applied
    q_sink: torch.Tensor | None,  # [n, H, D]: the queries rotated at the re-based sink positions; None: q
    kv: LayerKV,
    block_ids: torch.Tensor,  # [num_blocks] long, covering seq_len tokens (blocks no query reads may be stale)
    seq_len: int,
    scale: float,
    pattern: AttentionPattern | None,
    use_flex: bool | None = None,  # None: on a GPU, for chunks of FLEX_MIN_QUERIES queries and more
) -> torch.Tensor:  # [n, H, D]
    n = q.shape[0]
    out = torch.empty_like(q)
    rebase = q_sink is not None and pattern is not None and pattern.rebase_sinks and pattern.sinks > 0
    if use_flex is None:
        use_flex = q.is_cuda and n >= FLEX_MIN_QUERIES
    if use_flex and not rebase and pattern is not None and pattern.window is not None:
        return flex_sparse_attention(q, kv, block_ids, seq_len, scale, pattern)
    for start in range(0, n, QUERY_CHUNK):
        end = min(n, start + QUERY_CHUNK)
        q_pos = torch.arange(seq_len - n + start, seq_len - n + end, device=q.device)
        k_pos = key_positions(seq_len - n + start, seq_len - n + end, pattern, q.device)
        keys, values = gather_positions(kv, block_ids, k_pos, q.dtype)
        mask = allowed(q_pos, k_pos, pattern)  # [c, L]
        if rebase:
            sink = is_sink(q_pos, k_pos, pattern)
            out[start:end] = _explicit(q[start:end], q_sink[start:end], keys, values, mask, sink, scale)
        else:
            out[start:end] = _sdpa(q[start:end], keys, values, mask, scale)
    return out


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [c, H, D] over keys/values [L, Hkv, D] with mask [c, L] bool -> [c, H, D]. An additive float mask in 4-D
    with GQA keeps PyTorch's fused CPU kernel (a boolean one falls back to the math path)."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, c, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=bias[None, None],
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _explicit(
    q: torch.Tensor,
    q_sink: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    sink: torch.Tensor,  # [c, L] bool: columns scored with q_sink
    scale: float,
) -> torch.Tensor:
    """As _sdpa, with the sink columns scored by q_sink; fp32 scores for 16-bit inputs, fp64 stays fp64."""
    c, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)

    def heads(x: torch.Tensor) -> torch.Tensor:  # [c, H, D] -> [Hkv, G, c, D]
        return x.to(compute).view(c, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)

    k_t = keys.to(compute).permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, L]
    scores = torch.where(sink, heads(q_sink) @ k_t, heads(q) @ k_t) * scale  # [Hkv, G, c, L]
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1)
    out = probs @ values.to(compute).transpose(0, 1).unsqueeze(1)  # [Hkv, G, c, D]
    return out.permute(2, 0, 1, 3).reshape(c, num_heads, head_dim).to(q.dtype)


def pattern_mask_mod(offset: int, pattern: AttentionPattern, device) -> Callable:
    """flex_attention's mask_mod for queries at offset + q_idx over keys 0.. (allowed(), as scalar tensor ops). The
    numbers are captured as tensors, so one compiled kernel serves every offset and window."""
    off, window, sinks, stride = (torch.tensor(x, device=device) for x in (offset, pattern.window, pattern.sinks,
                                                                          max(pattern.stride, 1)))  # fmt: skip
    strided = pattern.stride > 0

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + off
        lo = q + 1 - window
        keep = (kv_idx >= lo) | ((kv_idx < sinks) & (kv_idx < lo))
        if strided:
            keep = keep | ((kv_idx < lo) & ((q - kv_idx) % stride == 0))
        return (kv_idx <= q) & keep

    return mask_mod


@functools.lru_cache(maxsize=16)
def _block_mask(n: int, seq_len: int, pattern: AttentionPattern, device: str):
    """The BlockMask of n queries ending a seq_len-token sequence (cached: every layer of a forward shares it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(pattern_mask_mod(seq_len - n, pattern, device), None, None, n, seq_len, device=device)


@functools.cache
def _flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_sparse_attention(
    q: torch.Tensor, kv: LayerKV, block_ids: torch.Tensor, seq_len: int, scale: float, pattern: AttentionPattern
) -> torch.Tensor:
    """sparse_attention of q [n, H, D] (no re-based sinks) as one flex_attention call over the whole prefix."""
    n = q.shape[0]
    keys, values = gather_positions(kv, block_ids, torch.arange(seq_len, device=q.device), q.dtype)
    mask = _block_mask(n, seq_len, pattern, str(q.device))
    out = _flex()(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, S, D]
        values.transpose(0, 1).unsqueeze(0),
        block_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
