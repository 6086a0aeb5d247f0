"""Long inputs through the engine: attention sinks + a window stream past the model's context with bounded KV,
released blocks never leak or corrupt a prefix-cache hit, and a prefill pattern changes only prompt rows."""

import pytest
import torch

from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion

GREEDY = dict(temperature=0, ignore_eos=True)


def test_sinks_and_a_window_stream_past_the_context_in_bounded_memory(make_tiny_engine):
    engine = make_tiny_engine(block_size=4, max_num_batched_tokens=32, attention_window=16, attention_sinks=4)
    context = engine.model_config.max_position_embeddings  # 512
    prompt = [5 + i % 200 for i in range(context - 20)]
    engine.add_request(prompt, SamplingParams(max_tokens=80, **GREEDY), "s")
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.unfinished_request_ids():
            held.append(engine.kv_cache_manager.num_held_blocks("s"))
    # the sinks' block + the window and a chunk of 32 (48 tokens over at most 13 blocks of 4), then the window and
    # the new token (17 tokens over at most 6 blocks), never the 143 blocks of 572 tokens
    assert max(held) <= 1 + 13 and max(held[-70:]) <= 1 + 6
    assert engine.model.rotary_emb.cos.shape[0] >= context + 60  # the table grew past the model's positions
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_a_window_wider_than_the_sequence_changes_nothing(make_tiny_engine):
    prompt = list(range(3, 40))
    outputs = []
    for options in ({}, {"attention_window": 1000, "attention_sinks": 4}, {"prefill_attention": "local-global",
                                                                           "prefill_window": 500}):  # fmt: skip
        engine = make_tiny_engine(block_size=4, **options)
        engine.add_request(prompt, SamplingParams(max_tokens=20, **GREEDY), "a")
        outputs.append(run_to_completion(engine)["a"].outputs[0].token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_prefill_pattern_changes_prompt_rows_only(make_tiny_engine):
    """local+global prefill reads fewer keys for prompt tokens (so its first token may differ); decodes read all."""
    prompt = list(range(3, 60))
    logprobs = []
    for options in ({}, {"prefill_attention": "local-global", "prefill_window": 8, "prefill_globals": 2}):
        engine = make_tiny_engine(block_size=4, **options)
        engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY), "a")
        out = run_to_completion(engine)["a"]
        logprobs.append([next(iter(d.values())) for d in out.prompt_logprobs[1:]])
    dense, sparse = torch.tensor(logprobs[0]), torch.tensor(logprobs[1])
    torch.testing.assert_close(dense[:8], sparse[:8])  # inside the window the pattern is dense attention
    assert (dense[10:] - sparse[10:]).abs().max() > 1e-6


def test_released_blocks_keep_a_later_prefix_hit_exact(make_tiny_engine):
    """A windowed request releases its middle blocks (their hashes stay until reused); a second request with the
    same prompt hits the cached prefix and must produce the same tokens as the first."""
    engine = make_tiny_engine(block_size=4, max_num_batched_tokens=8, attention_window=12)
    prompt = list(range(7, 47))
    runs = []
    for rid in ("first", "second"):
        engine.add_request(prompt, SamplingParams(max_tokens=16, **GREEDY), rid)
        runs.append(run_to_completion(engine)[rid].outputs[0].token_ids)
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    assert runs[0] == runs[1]
    assert engine.kv_cache_manager.prefix_cache_hits > 0


def test_sinks_without_a_window_are_refused(make_tiny_engine):
    with pytest.raises(ValueError, match="attention_window"):
        make_tiny_engine(attention_sinks=4)


def test_speculation_under_a_window_keeps_greedy_tokens(make_tiny_engine):
    """A self-draft reads the target's blocks, some released by the window: it gets the same patterns, and the
    verification keeps the tokens exact either way."""
    prompt = list(range(11, 50))
    runs = []
    for options in ({}, {"speculative": "self:1", "num_speculative_tokens": 3}):
        engine = make_tiny_engine(block_size=4, attention_window=12, attention_sinks=2, **options)
        engine.add_request(prompt, SamplingParams(max_tokens=24, **GREEDY), "a")
        runs.append(run_to_completion(engine)["a"].outputs[0].token_ids)
    assert runs[0] == runs[1]
