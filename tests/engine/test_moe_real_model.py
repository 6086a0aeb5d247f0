"""An MoE made from the real SmolLM2 (4 experts, top-2, upcycled in three layers, bf16) through the engine: the
native decode loop gives the per-layer path's tokens and counts its routing, pinned requests read only their
experts, a capacity drops and counts, and the weight bytes the counters read against are the model's."""

import pytest
import torch

from leanlm.compress import UpcycleConfig, compress
from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.kernels import cpu_decode
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion

pytestmark = pytest.mark.real_model
PROMPTS = ["The Eiffel Tower is", "In 1905, Albert Einstein", "def fibonacci(n):", "The capital of Japan"]


@pytest.fixture(scope="module")
def moe_net(smollm):
    model = build_model(smollm.config, smollm.state_dict, torch.float32)
    compress(model, [UpcycleConfig(num_experts=4, top_k=2, layers=(1, 3, 5), router_std=0.2, seed=1)],
             progress=False)  # fmt: skip
    return model.to(torch.bfloat16)


def generate(net, tokenizer, prompts, **options):
    engine = LLMEngine(net, tokenizer, EngineConfig.from_options(**options), torch.device("cpu"), torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, experts=options.pop("experts", None))
    ids = [engine.add_request(p, params) for p in prompts]
    final = run_to_completion(engine)
    return [final[i].outputs[0].token_ids for i in ids], engine.moe_stats()


def test_native_loop_and_per_layer_path_give_the_same_tokens(moe_net, real_tokenizer):
    before = [b.stats.native.clone() for b in moe_net.modules() if hasattr(b, "stats")]
    native, stats = generate(moe_net, real_tokenizer, PROMPTS)
    after = [b.stats.native for b in moe_net.modules() if hasattr(b, "stats")]
    moe_net.allow_native_decode = False
    try:
        reference, _ = generate(moe_net, real_tokenizer, PROMPTS)
    finally:
        moe_net.allow_native_decode = True
    assert native == reference
    if moe_net.native_decode_plan().loop is not None:  # CPUs with AVX512-BF16: the loop ran and counted
        assert all(int((a - b)[:4].sum()) > 0 for a, b in zip(after, before))
    assert stats.tokens > 0 and len(stats.expert_load) == 3 and stats.dropped == 0


def test_pinned_experts_and_a_capacity(moe_net, real_tokenizer):
    """The counters live on the model's layers (the engines here share one model): compared before and after."""
    engine = LLMEngine(moe_net, real_tokenizer, EngineConfig(), torch.device("cpu"), torch.bfloat16)
    before = engine.moe_stats()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, experts=(1, 2))
    engine.add_request(PROMPTS[0], params)
    run_to_completion(engine)
    after = engine.moe_stats()
    for old, new in zip(before.expert_load, after.expert_load):
        assert new[0] == old[0] and new[3] == old[3] and new[1] + new[2] > old[1] + old[2]
    capped = LLMEngine(moe_net, real_tokenizer, EngineConfig(moe_capacity_factor=0.5), torch.device("cpu"),
                       torch.bfloat16)  # fmt: skip
    for p in PROMPTS:
        capped.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    dropped = capped.moe_stats().dropped
    run_to_completion(capped)
    assert capped.moe_stats().dropped > dropped and capped.kv_cache_manager.num_free_blocks == capped.num_kv_blocks


def test_the_float32_loop_gives_the_per_layer_paths_tokens(smollm, real_tokenizer):
    """float32 activations (the AVX2 loop, decode_layers_f32.c): the same greedy tokens, routing counted there."""
    net = build_model(smollm.config, smollm.state_dict, torch.float32)
    compress(net, [UpcycleConfig(num_experts=4, top_k=2, layers=(1, 3, 5), router_std=0.2, seed=1)], progress=False)

    def run(native: bool):
        net.allow_native_decode = native
        engine = LLMEngine(net, real_tokenizer, EngineConfig(), torch.device("cpu"), torch.float32)
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in PROMPTS]
        final = run_to_completion(engine)
        return [final[i].outputs[0].token_ids for i in ids]

    before = [b.stats.native.clone() for b in net.modules() if hasattr(b, "stats")]
    native = run(True)
    after = [b.stats.native.clone() for b in net.modules() if hasattr(b, "stats")]
    assert native == run(False)
    if cpu_decode.is_available(torch.float32):  # the float32 loop ran the MoE layers and counted their routing
        assert net.native_decode_plan().loop.dtype is torch.float32
        assert all(int((a - b)[:4].sum()) > 0 for a, b in zip(after, before))
