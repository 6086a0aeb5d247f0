"""The PyTorch path of attention patterns: masks and key sets, re-based sinks as StreamingLLM defines them, and the
flex_attention mask the GPU path compiles."""

import pytest
import torch

from leanlm.config.long_context import LongContextConfig
from leanlm.model.attention_pattern import (
    AttentionPattern,
    StepPatterns,
    allowed,
    kv_window,
    row_bounds,
    sink_positions,
)
from leanlm.model.layers import RotaryEmbedding, apply_rotary
from leanlm.model.paged_kv import LayerKV
from leanlm.model.sparse_attention import key_positions, pattern_mask_mod, sparse_attention

H, HKV, D, BS = 4, 2, 16, 4


def test_allowed_is_the_union_of_sinks_strided_keys_and_the_window():
    p = AttentionPattern(window=3, sinks=2, stride=4)
    mask = allowed(torch.tensor([9]), torch.arange(12), p)[0]
    # window 7, 8, 9; sinks 0, 1; strided below the window: 9 - 4 = 5 (and 1, a sink already)
    assert torch.nonzero(mask).flatten().tolist() == [0, 1, 5, 7, 8, 9]
    assert p.num_keys(10) == 6
    assert row_bounds(torch.tensor([10]), p).tolist() == [[7, 2, 4]]


def test_key_positions_cover_every_query_of_a_chunk():
    p = AttentionPattern(window=5, sinks=2)
    keys = key_positions(10, 14, p, "cpu")
    assert keys.tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 12, 13]
    needed = allowed(torch.arange(10, 14), torch.arange(14), p).any(0)
    assert set(torch.nonzero(needed).flatten().tolist()) <= set(keys.tolist())


def test_the_flex_mask_equals_allowed():
    for p in (AttentionPattern(7), AttentionPattern(7, sinks=3), AttentionPattern(6, stride=6), AttentionPattern(50)):
        mod = pattern_mask_mod(20, p, "cpu")
        q, k = torch.arange(16)[:, None], torch.arange(36)[None]
        assert torch.equal(mod(0, 0, q, k), allowed(torch.arange(20, 36), torch.arange(36), p))


def test_flex_attention_with_the_pattern_mask_matches_the_reference():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator().manual_seed(0)
    n, seq_len = 32, 48
    kv = LayerKV(*(torch.randn(12, HKV, BS, D, generator=gen, dtype=torch.float64) for _ in range(2)), None, None)
    q = torch.randn(n, H, D, generator=gen, dtype=torch.float64)
    p = AttentionPattern(10, sinks=2)
    ref = sparse_attention(q, None, kv, torch.arange(12), seq_len, 0.25, p)
    keys = kv.k_cache.transpose(1, 2).reshape(-1, HKV, D)[:seq_len]
    values = kv.v_cache.transpose(1, 2).reshape(-1, HKV, D)[:seq_len]
    mask = flex.create_block_mask(pattern_mask_mod(seq_len - n, p, "cpu"), None, None, n, seq_len, device="cpu")
    out = flex.flex_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                              block_mask=mask, scale=0.25, enable_gqa=True)[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out, ref)


def test_re_based_sinks_see_the_query_at_its_position_in_the_cache():
    """StreamingLLM: the cache [sinks | window] is a sequence of its own, positions 0 .. S + W - 1. Keys stored
    rotated at their text positions plus the sinks scored with the query at sink_positions give exactly that."""
    gen = torch.Generator().manual_seed(1)
    sinks, window, p = 2, 5, 13  # the query at text position 13 reads keys 0, 1 and 9 .. 13
    rotary = RotaryEmbedding(D, 64, 10000.0, None)
    q_raw = torch.randn(1, H, D, generator=gen, dtype=torch.float64)
    k_raw = torch.randn(p + 1, HKV, D, generator=gen, dtype=torch.float64)
    v = torch.randn(p + 1, HKV, D, generator=gen, dtype=torch.float64)

    def rot(x, positions):
        cos, sin = rotary(torch.tensor(positions), torch.float64)
        return apply_rotary(x, cos, sin)

    kept = [0, 1, 9, 10, 11, 12, 13]
    cache_pos = list(range(len(kept)))  # the reference: the kept tokens as a sequence of their own
    ref_q, ref_k = rot(q_raw, [cache_pos[-1]]), rot(k_raw[kept], cache_pos)
    scores = torch.einsum("hd,khd->hk", ref_q[0], ref_k.repeat_interleave(H // HKV, 1)) * 0.25
    ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v[kept].repeat_interleave(H // HKV, 1))

    keys = rot(k_raw, list(range(p + 1)))  # stored at their text positions
    pattern = AttentionPattern(window, sinks, rebase_sinks=True)
    q_sink = rot(q_raw, sink_positions(torch.tensor([p + 1]), pattern).tolist())
    blocks = torch.arange(4)

    def paged(x):  # [p + 1, Hkv, D] -> blocks [4, Hkv, BS, D]
        padded = torch.cat((x, x.new_zeros(4 * BS - x.shape[0], HKV, D)))
        return padded.view(4, BS, HKV, D).transpose(1, 2).contiguous()

    kc, vc = paged(keys), paged(v)
    out = sparse_attention(rot(q_raw, [p]), q_sink, LayerKV(kc, vc, None, None), blocks, p + 1, 0.25, pattern)
    torch.testing.assert_close(out[0], ref)


def test_kv_window_needs_every_layer_bounded():
    streaming = StepPatterns.of(LongContextConfig(attention_window=64, attention_sinks=4))
    assert kv_window(streaming, (), 3) == (64, 4)
    assert kv_window(StepPatterns(), (32, 32), 2) == (32, 0)
    assert kv_window(StepPatterns(), (32, None), 2) is None  # a full layer reads every key
    prefill_only = StepPatterns.of(LongContextConfig(prefill_attention="local-global"))
    assert kv_window(prefill_only, (), 2) is None  # decodes stay dense
    assert kv_window(streaming, (16, None), 2) == (64, 4)  # the streaming window bounds the full layer


def test_patterns_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="window"):
        AttentionPattern(None, sinks=4)
    with pytest.raises(ValueError, match="attention_window"):
        LongContextConfig(attention_sinks=4)
    with pytest.raises(ValueError, match="use one"):
        LongContextConfig(attention_window=8, prefill_attention="strided")
