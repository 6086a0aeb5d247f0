"""Embedding requests (PoolingParams) in the engine that generates: the pooled final hidden states equal a plain
dense forward's (HF, float64) under chunked prefill, prefix-cache hits and preemption, in batches shared with
generation, whose tokens stay those of the dense forward; every KV block comes back."""

from __future__ import annotations

import pytest
import torch

from leanlm.pooling_params import PoolingParams
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict
from tests.engine.test_engine import _prompts, dense_greedy, dense_reference


def _reference_embedding(hf, prompt: list[int], params: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # [P, hidden], after the final norm
    pooled = hidden.mean(dim=0) if params.pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0) if params.normalize else pooled


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_embeddings_equal_dense_forward_beside_generation(make_tiny_engine, tokenizer, prefix_caching):
    engine = make_tiny_engine(
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        enable_prefix_caching=prefix_caching,
    )
    prompts = _prompts(tokenizer.vocab_size)
    generate = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    poolings = [PoolingParams("last"), PoolingParams("mean"), PoolingParams("mean", normalize=False)]
    gen_ids, embed_ids = [], []
    for i, prompt in enumerate(prompts):
        gen_ids.append(engine.add_request(prompt, generate))
        # the same prompts embedded twice over: the second of each hits the prefix the first left cached
        embed_ids += [(engine.add_request(prompt, p), prompt, p) for p in (poolings[i % 3], poolings[(i + 1) % 3])]
    outputs = run_to_completion(engine)

    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})
    for request_id, prompt in zip(gen_ids, prompts):
        assert outputs[request_id].outputs[0].token_ids == dense_greedy(hf, prompt, 12)
    for request_id, prompt, params in embed_ids:
        out = outputs[request_id]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        assert out.embedding.shape == (config.hidden_size,)
        # pooled in float32 (the embedding's dtype): float32 rounding of a float64 model's rows
        torch.testing.assert_close(out.embedding.double(), _reference_embedding(hf, prompt, params), atol=1e-6, rtol=0)
    if prefix_caching:
        assert engine.kv_cache_manager.prefix_cache_hits > 0
    assert engine.scheduler.stats().num_preemptions > 0, "the tiny pool must force preemption"
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_mean_pooling_never_takes_prefix_hits(make_tiny_engine, tokenizer):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=64)
    prompt = list(range(3, 40))
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    run_to_completion(engine)
    hits = engine.kv_cache_manager.prefix_cache_hits
    engine.add_request(prompt, PoolingParams("mean"))
    run_to_completion(engine)
    assert engine.kv_cache_manager.prefix_cache_hits == hits
    engine.add_request(prompt, PoolingParams("last"))  # the last token alone is enough: it may use the cache
    run_to_completion(engine)
    assert engine.kv_cache_manager.prefix_cache_hits > hits


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        PoolingParams("cls")
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")


def test_embedding_prompt_checks_run_before_queueing(make_tiny_engine):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=8, max_model_len=16)
    with pytest.raises(ValueError, match="context holds 16"):
        engine.add_request(list(range(3, 30)), PoolingParams())
    assert not engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="SamplingParams \\(or PoolingParams to embed\\)"):
        engine.add_request([5, 6], {"pooling": "mean"})
