"""Two engines over one model's weights: each forward carries its own engine's KV cache, so interleaved steps
give each request exactly the tokens it gets from an engine of its own (the model binds no cache)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.engine import LLMEngine
from leanlm.kernels import cpu_decode
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import tiny_config, tiny_state_dict


def _model(vocab_size: int, native: bool):
    config = tiny_config(vocab_size)
    if native:  # shapes the native decode loop takes (head_dim 64, 3 query heads per KV head)
        config = dataclasses.replace(config, hidden_size=384, intermediate_size=512, num_attention_heads=6, head_dim=64)
    dtype = torch.bfloat16 if native else torch.float64
    return build_model(config, tiny_state_dict(config, seed=4), dtype), dtype


def _engine(model, tokenizer, dtype, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(
        model, tokenizer, EngineConfig(block_size=4, num_kv_blocks=num_kv_blocks), torch.device("cpu"), dtype
    )


def _run(engine: LLMEngine, request_id: str) -> list[int]:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_interleaved_engines_over_one_model_do_not_share_a_cache(tokenizer, native):
    if native and not cpu_decode.is_available():
        pytest.skip("native CPU kernels unavailable")
    model, dtype = _model(tokenizer.vocab_size, native)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 29, 41, 53, 65, 77], [90, 80, 70, 60, 50]]
    alone = []
    for prompt in prompts:
        engine = _engine(model, tokenizer, dtype, 32)
        alone.append(_run(engine, engine.add_request(prompt, params)))
    # Both engines use blocks 0, 1, ... for their request: one shared cache would mix their K/V.
    first, second = _engine(model, tokenizer, dtype, 32), _engine(model, tokenizer, dtype, 24)
    ids = [first.add_request(prompts[0], params, "a"), second.add_request(prompts[1], params, "b")]
    tokens: dict[str, list[int]] = {}
    while first.has_unfinished_requests() or second.has_unfinished_requests():
        for engine in (first, second):  # one step each, in turn
            for out in engine.step() if engine.has_unfinished_requests() else []:
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
    assert [tokens[ids[0]], tokens[ids[1]]] == alone
    if native:
        plan = model.native_decode_plan()
        assert plan.loop is not None  # the decode steps ran on the native loop, rebinding caches as they alternated
