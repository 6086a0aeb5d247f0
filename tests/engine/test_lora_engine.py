"""Many LoRA adapters in one engine: requests with different adapters (and none) share every batch, and each gets
what its adapter merged into the base gives alone (float32, 1e-4); on an int4 base, what the int4 base plus the float
product gives. Adapters beyond the slots wait and are evicted least recently used; their KV is never shared."""

from __future__ import annotations

import copy

import pytest
import torch

from leanlm.compress import RTNConfig, compress
from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.formats.peft import read_adapter, write_adapter
from leanlm.lora_request import LoRARequest
from leanlm.model.llama import build_model
from leanlm.model.lora import lora_delta, lora_target_shapes
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=0, full_prompt_logprobs=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(n, s) for n, s in ((9, 1), (6, 2), (13, 3), (5, 4), (8, 5), (11, 6), (7, 7), (10, 8))]


@pytest.fixture(scope="module")
def setup(tokenizer, tmp_path_factory):
    """(config, base state dict, {name: adapter dir}) for five random adapters of ranks 2-8 on various targets."""
    config = tiny_config(tokenizer.vocab_size)
    state = tiny_state_dict(config)
    shapes = lora_target_shapes(config)
    gen = torch.Generator().manual_seed(10)
    paths = {}
    for k, (rank, kinds) in enumerate(
        [(4, None), (2, ("q_proj", "v_proj")), (8, ("o_proj", "down_proj", "gate_proj")), (3, None), (5, ("up_proj",))]
    ):
        weights = {
            name: (torch.randn(rank, i, generator=gen) * 0.3, torch.randn(o, rank, generator=gen) * 0.3)
            for name, (o, i) in shapes.items()
            if kinds is None or name.split(".")[-1] in kinds
        }
        paths[f"a{k}"] = str(write_adapter(tmp_path_factory.mktemp(f"a{k}"), weights, rank, 2.0 * rank, None))
    return config, state, paths


def _merged(state: dict, path: str) -> dict:
    adapter = read_adapter(path)
    merged = dict(state)
    for name, (a, b) in adapter.weights.items():
        merged[f"{name}.weight"] = state[f"{name}.weight"] + adapter.scaling(name) * (b @ a)
    return merged


def _engine(model, tokenizer, **options) -> LLMEngine:
    options = {"block_size": 4, "num_kv_blocks": 64, "max_num_batched_tokens": 40, **options}
    return LLMEngine(model, tokenizer, EngineConfig.from_options(**options), torch.device("cpu"), torch.float32)


def _run(engine: LLMEngine, prompts, loras, params: SamplingParams = PARAMS) -> list:
    ids = [engine.add_request(p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
    final = run_to_completion(engine)
    return [final[i] for i in ids]


def _assert_same(got, want):
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    torch.testing.assert_close(got.prompt_logprobs_full, want.prompt_logprobs_full, atol=1e-4, rtol=0)


def _alone_merged(config, state, paths, tokenizer, prompt, name):
    merged = state if name is None else _merged(state, paths[name])
    (out,) = _run(_engine(build_model(config, merged, torch.float32), tokenizer), [prompt], [None])
    return out


# runs of rows per step: 6 requests over 3 adapters and the base (4 runs at decode: one product per run), and 8
# requests (6 runs: one masked product over the stacked slots)
@pytest.mark.parametrize(
    "names", [["a0", None, "a1", "a2", "a0", None], ["a0", None, "a1", "a2", "a0", "a1", None, "a2"]]
)
def test_a_mixed_batch_equals_each_adapter_merged_and_alone(setup, tokenizer, names):
    config, state, paths = setup
    engine = _engine(build_model(config, state, torch.float32), tokenizer, enable_lora=True, max_loras=4)
    loras = [None if n is None else LoRARequest(n, paths[n]) for n in names]
    batch = _run(engine, PROMPTS[: len(names)], loras)
    for prompt, name, got in zip(PROMPTS, names, batch):
        _assert_same(got, _alone_merged(config, state, paths, tokenizer, prompt, name))
        (alone,) = _run(engine, [prompt], [None if name is None else LoRARequest(name, paths[name])])
        _assert_same(got, alone)
    assert engine.lora_manager.num_evictions == 0


def test_on_an_int4_base_equals_the_int4_base_plus_the_float_product(setup, tokenizer):
    config, state, paths = setup
    int4 = build_model(config, state, torch.float32)
    compress(int4, [RTNConfig(bits=4, group_size=32)], progress=False)
    names = ["a0", None, "a3", "a2", "a0", "a3", None]
    engine = _engine(int4, tokenizer, enable_lora=True, max_loras=3)
    batch = _run(engine, PROMPTS[: len(names)], [None if n is None else LoRARequest(n, paths[n]) for n in names])
    for prompt, name, got in zip(PROMPTS, names, batch):
        reference = copy.deepcopy(int4)
        if name is not None:
            adapter = read_adapter(paths[name])
            for module, (a, b) in adapter.weights.items():
                scale = adapter.scaling(module)
                reference.get_submodule(module).register_forward_hook(
                    lambda m, args, y, a=a, b=b, scale=scale: y + lora_delta(args[0], a, b, scale)
                )
        (want,) = _run(_engine(reference, tokenizer), [prompt], [None])
        _assert_same(got, want)


def test_more_adapters_than_slots_wait_and_evict_least_recently_used(setup, tokenizer):
    config, state, paths = setup
    engine = _engine(build_model(config, state, torch.float32), tokenizer, enable_lora=True, max_loras=2)
    names = ["a0", "a1", "a2", None, "a3", "a4", "a0", "a2"]
    params = dict(zip(range(len(names)), names))
    ids = [
        engine.add_request(p, PARAMS, lora_request=None if n is None else LoRARequest(n, paths[n]))
        for p, n in zip(PROMPTS, names)
    ]
    final = {}
    while engine.has_unfinished_requests():
        running = {r.lora_request.name for r in engine.scheduler.running if r.lora_request is not None}
        assert len(running) <= 2
        assert running <= set(engine.lora_manager.slot_of)  # running requests' adapters keep their slots
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.lora_manager.num_evictions >= 3
    for i, request_id in enumerate(ids):
        _assert_same(final[request_id], _alone_merged(config, state, paths, tokenizer, PROMPTS[i], params[i]))


def test_an_adapters_kv_is_not_a_prefix_hit_for_the_base_or_another_adapter(setup, tokenizer):
    config, state, paths = setup
    engine = _engine(build_model(config, state, torch.float32), tokenizer, enable_lora=True)
    prompt = _prompt(17, 9)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)  # prompt logprobs would skip the cache
    loras = [LoRARequest("a0", paths["a0"]), None, LoRARequest("a1", paths["a1"]), LoRARequest("a0", paths["a0"])]
    loras.append(LoRARequest("a0", paths["a0"], scale=0.5))  # another scale is another adapter for the cache
    outs = [_run(engine, [prompt], [lora], params)[0] for lora in loras]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 0, 16, 0]  # only a0's second run reuses a0's KV
    assert outs[3].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for out, lora in zip(outs[:3], loras):
        merged = state if lora is None else _merged(state, lora.path)
        (want,) = _run(_engine(build_model(config, merged, torch.float32), tokenizer), [prompt], [None], params)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_lora_requests_need_an_engine_with_lora_and_one_path_per_name(setup, tokenizer):
    config, state, paths = setup
    plain = _engine(build_model(config, state, torch.float32), tokenizer)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_request(PROMPTS[0], PARAMS, lora_request=LoRARequest("a0", paths["a0"]))
    engine = _engine(build_model(config, state, torch.float32), tokenizer, enable_lora=True)
    engine.add_request(PROMPTS[0], PARAMS, lora_request=LoRARequest("a0", paths["a0"]))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(PROMPTS[0], PARAMS, lora_request=LoRARequest("a0", paths["a1"]))
    with pytest.raises(ValueError, match="one process"):
        EngineConfig.from_options(enable_lora=True, tensor_parallel_size=2)


def test_a_lora_decode_batch_leaves_the_native_loop_and_a_base_batch_keeps_it(setup, tokenizer, monkeypatch):
    from leanlm.model.native_decode import NativeDecodePlan

    config, state, paths = setup
    calls = []
    original = NativeDecodePlan.run
    monkeypatch.setattr(
        NativeDecodePlan, "run", lambda self, x, p, ctx: calls.append(ctx.lora) or original(self, x, p, ctx)
    )
    model = build_model(config, state, torch.bfloat16)
    engine = LLMEngine(
        model, tokenizer, EngineConfig.from_options(enable_lora=True), torch.device("cpu"), torch.bfloat16
    )
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_completion(engine)
    assert calls and all(c is None for c in calls)
    calls.clear()
    engine.add_request(
        PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), lora_request=LoRARequest("a0", paths["a0"])
    )
    run_to_completion(engine)
    assert calls and all(c is not None for c in calls)  # refused inside run(): the PyTorch path ran


@pytest.mark.real_model
def test_an_adapter_on_smollm2_changes_generation_and_equals_it_merged(smollm, real_tokenizer, tmp_path):
    """A random rank-8 adapter on SmolLM2 (q, v, down): its greedy text differs from the base model's and equals the
    adapter merged into the float32 weights, prompt log-probabilities within 1e-4; the base rows of the same batch
    stay the base model's."""
    config, state = smollm.config, smollm.state_dict
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(8, i, generator=gen) / i**0.5, torch.randn(o, 8, generator=gen) * 0.05)
        for name, (o, i) in lora_target_shapes(config).items()
        if name.split(".")[-1] in ("q_proj", "v_proj", "down_proj")
    }
    path = str(write_adapter(tmp_path / "smol", weights, 8, 16.0, "smollm2-135m-instruct"))
    prompt = real_tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0, full_prompt_logprobs=True)
    options = {"num_kv_blocks": 64, "act_quant": "none"}

    def run(model, loras, **extra):
        engine = LLMEngine(model, real_tokenizer, EngineConfig.from_options(**options, **extra), torch.device("cpu"),
                           torch.float32)  # fmt: skip
        return _run(engine, [prompt] * len(loras), loras, params)

    adapted, base = run(build_model(config, state, torch.float32), [LoRARequest("smol", path), None], enable_lora=True)
    (merged,) = run(build_model(config, _merged(state, path), torch.float32), [None])
    (plain,) = run(build_model(config, state, torch.float32), [None])
    assert adapted.outputs[0].token_ids != plain.outputs[0].token_ids
    _assert_same(adapted, merged)
    _assert_same(base, plain)
