"""Parallel sampling (n > 1): the prompt is computed once and its KV blocks shared copy-on-write; each sample
equals the same request run alone, and every block comes back."""

from __future__ import annotations

import random

from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion


def _peak_blocks(engine) -> tuple[dict, int]:
    """Run to completion, returning the final outputs and the most KV blocks held at once."""
    final, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        peak = max(peak, engine.num_kv_blocks - engine.kv_cache_manager.num_free_blocks)
    return final, peak


def _prompt(vocab: int, length: int) -> list[int]:
    rng = random.Random(3)
    return [rng.randrange(3, vocab) for _ in range(length)]


def test_samples_share_the_prompt_and_equal_independent_requests(make_tiny_engine, tokenizer):
    prompt = _prompt(tokenizer.vocab_size, 70)
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    options = dict(block_size=16, num_kv_blocks=64, enable_prefix_caching=False)
    engine = make_tiny_engine(**options)
    rid = engine.add_request(prompt, params)
    outputs, shared_peak = _peak_blocks(engine)
    samples = [c.token_ids for c in outputs[rid].outputs]
    assert len({tuple(s) for s in samples}) > 1, "seeded siblings (seed + i) must differ"
    alone_peak = 0
    for i, sample in enumerate(samples):
        alone = make_tiny_engine(**options)
        one = alone.add_request(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11 + i, ignore_eos=True))
        out, peak = _peak_blocks(alone)
        assert out[one].outputs[0].token_ids == sample
        alone_peak += peak
    # Between steps, each alone holds up to 5 blocks (80 tokens with KV). Shared: the prompt's 5 blocks once, 3
    # copies of its partial last block (the first sample writes into its own), and nothing more: 12 tokens fit in it.
    assert alone_peak == 4 * 5
    assert shared_peak == 5 + 3
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_abort_and_failure_paths_return_every_block(make_tiny_engine, tokenizer):
    prompt = _prompt(tokenizer.vocab_size, 40)
    engine = make_tiny_engine(block_size=16, num_kv_blocks=64, max_num_batched_tokens=16)  # chunked prompt
    rid = engine.add_request(prompt, SamplingParams(n=3, max_tokens=30, temperature=1.0))
    engine.step()  # first chunk: the siblings still wait to fork
    final = engine.abort_request(rid)
    assert final.finished and all(c.finish_reason == "abort" for c in final.outputs)
    assert engine.kv_cache_manager.num_free_blocks == 64 and not engine.has_unfinished_requests()
    rid = engine.add_request(prompt, SamplingParams(n=3, max_tokens=30, temperature=1.0))
    for _ in range(6):
        engine.step()  # forked and decoding
    final = engine.abort_request(rid)
    assert len(final.outputs) == 3 and engine.kv_cache_manager.num_free_blocks == 64


def test_greedy_n_and_prompt_logprobs_requests(make_tiny_engine, tokenizer):
    prompt = _prompt(tokenizer.vocab_size, 20)
    engine = make_tiny_engine(num_kv_blocks=64)
    rid = engine.add_request(prompt, SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True))
    lp = engine.add_request(prompt, SamplingParams(n=2, max_tokens=4, prompt_logprobs=1, ignore_eos=True))
    outputs = run_to_completion(engine)
    assert len({tuple(c.token_ids) for c in outputs[rid].outputs}) == 1  # greedy siblings agree
    assert len(outputs[lp].prompt_logprobs) == len(prompt)  # such groups are not forked: all positions scored
    assert engine.kv_cache_manager.num_free_blocks == 64
