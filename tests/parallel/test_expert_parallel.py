"""MoE layers over 2 local gloo processes: tensor-parallel experts, and expert parallelism with all-to-all dispatch
and combine, give the one-process engine's greedy tokens and logprobs (float32), with and without a capacity."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leanlm import LLM, SamplingParams
from leanlm.config.moe import MoEConfig
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.native import save_checkpoint
from leanlm.model.llama import build_model
from leanlm.parallel.expert import expert_bounds, token_bounds
from tests.conftest import tiny_config, tiny_state_dict
from tests.parallel.test_parallel_engine import _assert_same, _run

# 5 experts split 2 + 3 over the ranks; a shared expert with its gate; layer 1 dense
MOE = MoEConfig(num_experts=5, top_k=2, expert_intermediate_size=64, scoring="softmax",
                shared_expert_intermediate_size=32, shared_expert_gate=True, sparse_layers=(0, 2))  # fmt: skip


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from tests.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = dataclasses.replace(
        tiny_config(tokenizer.vocab_size), hidden_size=192, num_attention_heads=6, num_key_value_heads=3,
        head_dim=32, intermediate_size=256, num_hidden_layers=3, moe=MOE,
    )  # fmt: skip
    model = build_model(config, tiny_state_dict(config, seed=4), torch.float32)
    path = tmp_path_factory.mktemp("moe") / "ckpt"
    save_checkpoint(Checkpoint(model, tokenizer), path, dtype=torch.float32)
    return str(path)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tp-experts", "expert-parallel"])
def test_two_ranks_equal_one_process(moe_checkpoint, options):
    want = _run(moe_checkpoint)
    _assert_same(_run(moe_checkpoint, tensor_parallel_size=2, **options), want)


def test_expert_parallel_applies_the_capacity_over_the_whole_step(moe_checkpoint):
    capacity = dict(moe_capacity_factor=0.5, moe_batch_priority=True)
    want = _run(moe_checkpoint, **capacity)
    _assert_same(_run(moe_checkpoint, tensor_parallel_size=2, enable_expert_parallel=True, **capacity), want)


def test_moe_stats_of_a_parallel_engine_count_the_whole_routing(moe_checkpoint):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(moe_checkpoint, dtype="float32", progress=False) as one:
        one.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)
        want = one.llm_engine.stats().moe
    with LLM(
        moe_checkpoint, dtype="float32", progress=False, tensor_parallel_size=2, enable_expert_parallel=True
    ) as ep:
        ep.generate([[5, 6, 7, 8]], greedy, use_tqdm=False)
        got = ep.llm_engine.stats().moe
    assert got.expert_load == want.expert_load and got.tokens == want.tokens


def test_bounds():
    assert expert_bounds(5, 2) == [0, 2, 5]
    assert token_bounds(3, 2) == [0, 1, 3] and token_bounds(1, 2) == [0, 0, 1]
    with pytest.raises(ValueError, match="at least 4 experts"):
        expert_bounds(3, 4)
