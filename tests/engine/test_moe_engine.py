"""A mixture-of-experts model in the engine: batched greedy equals alone, capacity options reach the layers,
requests pin expert subsets (static task routing), EngineStats.moe counts it, bad input is refused."""

import dataclasses

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.config.moe import MoEConfig
from leanlm.engine import LLMEngine
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

MOE = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=32, shared_expert_intermediate_size=16)
PROMPTS = [[5, 9, 13, 2 + i, 40, 41 + i] for i in range(5)]


@pytest.fixture
def make_moe_engine(tokenizer):
    def make(**options) -> LLMEngine:
        config = dataclasses.replace(tiny_config(tokenizer.vocab_size), moe=MOE)
        model = build_model(config, tiny_state_dict(config, seed=3), torch.float64)
        return LLMEngine(model, tokenizer, EngineConfig.from_options(**options), torch.device("cpu"), torch.float64)

    return make


def generate(engine, prompts, **params):
    ids = [
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **params)) for p in prompts
    ]
    final = run_to_completion(engine)
    return [final[i].outputs[0].token_ids for i in ids]


def test_batched_greedy_equals_alone(make_moe_engine):
    batched = generate(make_moe_engine(), PROMPTS)
    alone = [generate(make_moe_engine(), [p])[0] for p in PROMPTS]
    assert batched == alone


def test_pinned_experts_are_the_only_ones_read(make_moe_engine):
    engine = make_moe_engine()
    generate(engine, PROMPTS[:2], experts=(1, 3))
    stats = engine.stats().moe
    assert stats.tokens > 0 and all(load[0] == load[2] == 0 for load in stats.expert_load)
    assert all(load[1] + load[3] == stats.tokens * 2 for load in stats.expert_load)


def test_a_pinned_request_batched_with_others_equals_it_alone(make_moe_engine):
    pinned_alone = generate(make_moe_engine(), PROMPTS[:1], experts=(0, 2))[0]
    engine = make_moe_engine()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, experts=(0, 2))
    pinned = engine.add_request(PROMPTS[0], params)
    for p in PROMPTS[1:]:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert run_to_completion(engine)[pinned].outputs[0].token_ids == pinned_alone
    assert generate(make_moe_engine(), PROMPTS[:1])[0] != pinned_alone  # pinning changed the routing


def test_capacity_factor_reaches_the_layers_and_drops_are_counted(make_moe_engine):
    engine = make_moe_engine(moe_capacity_factor=0.5, moe_batch_priority=True)
    generate(engine, PROMPTS)
    stats = engine.stats().moe
    assert stats.dropped > 0 and 0 < stats.drop_rate < 1
    free = make_moe_engine()
    generate(free, PROMPTS)
    assert free.stats().moe.dropped == 0


def test_the_layout_of_a_moe_engine_names_its_routing(make_moe_engine):
    engine = make_moe_engine(moe_capacity_factor=1.25)
    layout = engine.layout()
    assert layout.num_streamed_layers == 0 and layout.resident_weight_bytes is None
    cfg = engine.model_config.moe
    assert (layout.num_experts, layout.top_k, layout.moe_capacity_factor) == (cfg.num_experts, cfg.top_k, 1.25)
    assert f"MoE: {cfg.num_experts} experts, top-{cfg.top_k}, capacity factor 1.25" in layout.describe()
    assert "offloaded" not in layout.describe() and "parallel" not in layout.describe()


def test_bad_expert_requests_are_refused(make_moe_engine, make_tiny_engine):
    engine = make_moe_engine()
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        engine.add_request(PROMPTS[0], SamplingParams(experts=(1, 7)))
    with pytest.raises(ValueError, match="at least top-k = 2"):
        engine.add_request(PROMPTS[0], SamplingParams(experts=(1,)))
    with pytest.raises(ValueError, match="dense"):
        make_tiny_engine().add_request(PROMPTS[0], SamplingParams(experts=(0, 1)))
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(experts=())
    assert not engine.has_unfinished_requests()


def test_engine_config_checks_moe_options():
    with pytest.raises(ValueError, match="moe-capacity-factor"):
        EngineConfig(moe_capacity_factor=-1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        EngineConfig(moe_batch_priority=True)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig(enable_expert_parallel=True)
