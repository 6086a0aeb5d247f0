"""Long-input options on the bundled SmolLM2-135M-Instruct: sinks + a window stream with bounded KV, the native decode
loop agreeing with the per-layer path under them, and a KV budget holding its blocks down."""

import pytest

from leanlm import LLM, SamplingParams

pytestmark = pytest.mark.real_model

PROMPT = "Write a long story about a lighthouse keeper and the ships she watches. " * 4
GREEDY = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)


def _held_blocks(llm: LLM) -> tuple[list[int], list[int]]:
    """Generate PROMPT greedily, step by step: the tokens and the request's blocks held after each step."""
    engine = llm.llm_engine
    engine.add_request(PROMPT, GREEDY, "r")
    held, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        if engine.unfinished_request_ids():
            held.append(engine.kv_cache_manager.num_held_blocks("r"))
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks  # nothing leaked
    return tokens, held


def test_sinks_and_a_window_on_the_real_model():
    options = dict(attention_window=48, attention_sinks=4, act_quant="none", block_size=16)
    native, held = _held_blocks(LLM(**options))
    # the sinks' block, the window and the new token: at most 1 + 4 blocks of 16 from the first decodes on
    assert len(native) == 96 and max(held[2:]) <= 5
    per_layer = LLM(**options)
    per_layer.llm_engine.model.disable_native_decode()
    assert _held_blocks(per_layer)[0] == native  # the loop and the per-layer path share the kernel's arithmetic


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_a_kv_budget_on_the_real_model(policy):
    tokens, held = _held_blocks(LLM(kv_budget=32, kv_eviction=policy, act_quant="none", block_size=16))
    # 32 kept + up to one block (16) before the next compaction + the step's token: 49 tokens, 4 blocks of 16
    assert len(tokens) == 96 and max(held[2:]) <= 4
