"""Long-context costs by hand on a tiny shape: L=2 layers, H=2 query heads and Hkv=1 KV head of D=4, so one token's
bf16 K and V take 2 * L * Hkv * D * 2 = 32 bytes and one (query, key) pair 4 * L * H * D = 64 attention FLOPs."""

from __future__ import annotations

import pytest

from leanlm.analysis.estimate import kv_format, matmul_flops_per_token, prefill_flops
from leanlm.analysis.estimate_long_context import (
    LONG_CONTEXTS,
    AttentionCost,
    BoundedAttention,
    budget_cost,
    full_cost,
    long_context_rows,
    long_contexts,
    prefill_attention_flops,
    prefill_key_reads,
    window_cost,
    window_keys,
)
from leanlm.analysis.model_shape import PRESETS, ModelShape

TINY = ModelShape("tiny", 10, 8, 8, 2, 2, 1, 4, max_context=6)
KV = kv_format("bf16", TINY.head_dim)


def test_prefill_key_reads_count_each_query_once():
    assert prefill_key_reads(5) == 1 + 2 + 3 + 4 + 5
    assert prefill_key_reads(5, keys=3) == 1 + 2 + 3 + 3 + 3
    assert prefill_key_reads(3, keys=5) == prefill_key_reads(3) == 6  # a bound past the prompt changes nothing
    assert prefill_key_reads(1000, keys=10) == 55 + 990 * 10


def test_full_prefill_attention_is_the_attention_term_of_prefill_flops():
    n = 7
    rest = n * matmul_flops_per_token(TINY, with_logits=False) + 2 * TINY.vocab_size * TINY.hidden_size
    assert prefill_attention_flops(TINY, n) == prefill_flops(TINY, n) - rest == 64 * 28


def test_costs_at_five_tokens_by_hand():
    assert full_cost(TINY, KV, 5) == AttentionCost(5, 160, 5, 320, 64 * 15)
    # window 2 + 1 sink: 3 keys for every query past the third
    assert window_keys(5, 2, 1) == 3
    assert window_cost(TINY, KV, 5, window=2, sinks=1) == AttentionCost(3, 96, 3, 192, 64 * 12)
    # budget 4: 4 tokens cached and read by decodes, but the prompt was attended in full
    assert budget_cost(TINY, KV, 5, budget=4) == AttentionCost(4, 128, 4, 256, 64 * 15)


def test_bounds_past_the_context_cost_what_full_attention_costs():
    assert window_cost(TINY, KV, 2, window=2, sinks=1) == full_cost(TINY, KV, 2)
    assert budget_cost(TINY, KV, 2, budget=4) == full_cost(TINY, KV, 2)


def test_rows_cover_4k_to_128k_and_the_models_own_context():
    assert long_contexts() == list(LONG_CONTEXTS) == [4096, 8192, 16384, 32768, 65536, 131072]
    assert long_contexts(8192) == list(LONG_CONTEXTS)
    assert long_contexts(TINY.max_context) == [6, *LONG_CONTEXTS]
    rows = long_context_rows(TINY, KV, BoundedAttention(window=2), [6])
    assert rows[0].window == window_cost(TINY, KV, 6, 2) and rows[0].budget is None
    assert PRESETS["llama-3.1-8b"].max_context == 131072


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": 0}, "--attention-window must be >= 1"),
        ({"kv_budget": 0}, "--kv-budget must be >= 1"),
        ({"window": 8, "sinks": -1}, "--attention-sinks must be >= 0"),
        ({"sinks": 4}, "set --attention-window too"),
    ],
)
def test_bad_bounds_say_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BoundedAttention(**kwargs)
