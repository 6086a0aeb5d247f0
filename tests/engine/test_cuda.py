"""The engine on CUDA (the code is device-agnostic): marked `gpu`, skipped without CUDA (tests/conftest.py).

Tiny random models keep these in the fast tier; the float64 ones have no greedy near ties, so CPU and GPU
must agree token for token.
"""

from __future__ import annotations

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 29, 41, 53, 65, 77], [90, 80, 70, 60, 50], list(range(100, 140))]


def _engine(tokenizer, device: str, dtype: torch.dtype, **options) -> LLMEngine:
    config = tiny_config(tokenizer.vocab_size)
    model = build_model(config, tiny_state_dict(config), dtype, device=device)
    options.setdefault("num_kv_blocks", 64)
    return LLMEngine(model, tokenizer, EngineConfig.from_options(block_size=4, **options), torch.device(device), dtype)


def _tokens(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in PROMPTS]
    outputs = run_to_completion(engine)
    return [outputs[i].outputs[0].token_ids for i in ids]


def test_greedy_tokens_match_the_cpu(tokenizer):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = _tokens(_engine(tokenizer, "cpu", torch.float64), params)
    assert _tokens(_engine(tokenizer, "cuda", torch.float64, max_num_batched_tokens=16), params) == cpu


def test_int8_kv_cache_runs_and_follows_the_float_cache(tokenizer):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    float_tokens = _tokens(_engine(tokenizer, "cuda", torch.float32), params)
    int8 = _engine(tokenizer, "cuda", torch.float32, kv_cache_dtype="int8")
    assert int8.kv_cache_dtype == torch.int8
    int8_tokens = _tokens(int8, params)
    # 8-bit K/V move logits by about a quantization step: the first tokens, far from ties here, agree
    assert sum(a[:2] == b[:2] for a, b in zip(int8_tokens, float_tokens)) >= len(PROMPTS) - 1
    assert int8.stats().num_free_kv_blocks == int8.num_kv_blocks


def test_seeded_sampling_is_reproducible(tokenizer):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = _tokens(_engine(tokenizer, "cuda", torch.float32), params)
    assert _tokens(_engine(tokenizer, "cuda", torch.float32), params) == first


def test_unseeded_sampling_and_prompt_logprobs_run_on_the_gpu(tokenizer):
    """The paths `leanlm eval ppl` takes: random draws made on the logits' device, and prompt logprobs."""
    engine = _engine(tokenizer, "cuda", torch.float32)
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, prompt_logprobs=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    outputs = run_to_completion(engine)
    for i, prompt in zip(ids, PROMPTS, strict=True):
        assert len(outputs[i].outputs[0].token_ids) == 6
        assert len(outputs[i].prompt_logprobs) == len(prompt)
    assert engine.stats().num_free_kv_blocks == engine.num_kv_blocks


@pytest.mark.parametrize(
    "options",
    [
        {"attention_window": 12, "attention_sinks": 4},
        {"prefill_attention": "local-global", "prefill_window": 8, "prefill_globals": 2},
        {"prefill_attention": "strided", "prefill_window": 6},
        {"kv_budget": 12, "kv_eviction": "snapkv"},
        {"kv_budget": 12, "kv_eviction": "h2o"},
    ],
    ids=["sinks", "local-global", "strided", "budget-snapkv", "budget-h2o"],
)
def test_attention_patterns_match_the_cpu(tokenizer, options):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # the same chunks on both sides: a KV budget compacts at step boundaries, so chunking changes what it keeps
    cpu = _tokens(_engine(tokenizer, "cpu", torch.float64, max_num_batched_tokens=16, **options), params)
    assert _tokens(_engine(tokenizer, "cuda", torch.float64, max_num_batched_tokens=16, **options), params) == cpu
