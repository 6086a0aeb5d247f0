"""PEFT's LoRA format both ways: an adapter PEFT saved gives our engine PEFT's logits; one we write, PEFT loads and
gives ours; what we cannot apply is refused by name, before anything is allocated."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.formats.hf_dir import load_hf_dir
from leanlm.formats.peft import AdapterError, read_adapter, write_adapter
from leanlm.lora_request import LoRARequest
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import hf_tiny, run_to_completion

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_hf(vocab_size: int):
    return hf_tiny(
        "LlamaForCausalLM",
        "LlamaConfig",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def peft_adapter(hf, path, seed: int, r: int = 4, targets=ALL_TARGETS, **config):
    """PEFT's LoRA over a copy of `hf`, its B moved off zero (A too), saved to `path`: (the PeftModel, path)."""
    import copy

    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=0.0, **config)
    model = peft.get_peft_model(copy.deepcopy(hf), lora).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    """(HF model, the directory it is saved in, our float32 model of it)."""
    hf = tiny_hf(tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("base")
    hf.save_pretrained(path)
    config, state = load_hf_dir(path, dtype=torch.float32, progress=False)
    return hf, path, build_model(config, state, torch.float32)


def engine_for(model, tokenizer, **options) -> LLMEngine:
    options = {"enable_lora": True, "block_size": 4, "max_num_batched_tokens": 64, **options}
    return LLMEngine(model, tokenizer, EngineConfig.from_options(**options), torch.device("cpu"), torch.float32)


def prompt_logprobs(engine: LLMEngine, prompts, loras) -> list[torch.Tensor]:
    """Every prompt's full log-softmax rows [T-1, V], all prompts in one batch, each with its adapter (or None)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, full_prompt_logprobs=True)
    ids = [engine.add_request(p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
    final = run_to_completion(engine)
    return [final[i].prompt_logprobs_full for i in ids]


def reference(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)


PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 300, 12, 64]


def test_a_peft_adapter_gives_peft_logits(base, tokenizer, tmp_path):
    hf, _, ours = base
    model, path = peft_adapter(hf, tmp_path / "a", seed=1)
    (got,) = prompt_logprobs(engine_for(ours, tokenizer), [PROMPT], [LoRARequest("a", str(path))])
    torch.testing.assert_close(got, reference(model, PROMPT), atol=1e-4, rtol=0)
    # the adapter changed something: the base model's logits are far from them
    assert (got - reference(hf, PROMPT)).abs().max() > 1e-2


def test_rslora_alpha_pattern_and_fewer_targets(base, tokenizer, tmp_path):
    hf, _, ours = base
    model, path = peft_adapter(
        hf, tmp_path / "a", seed=2, r=8, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True,
        alpha_pattern={"down_proj": 3.0}, rank_pattern={"v_proj": 2},
    )  # fmt: skip
    adapter = read_adapter(path)
    assert adapter.rank("model.layers.0.self_attn.v_proj") == 2
    (got,) = prompt_logprobs(engine_for(ours, tokenizer), [PROMPT], [LoRARequest("a", str(path))])
    torch.testing.assert_close(got, reference(model, PROMPT), atol=1e-4, rtol=0)


def test_an_adapter_we_write_loads_in_peft_with_our_logits(base, tokenizer, tmp_path):
    hf, base_path, ours = base
    gen = torch.Generator().manual_seed(3)
    weights = {}
    for i in range(2):
        for name, (out_f, in_f) in {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (32, 64),
                                    "mlp.up_proj": (96, 64)}.items():  # fmt: skip
            weights[f"model.layers.{i}.{name}"] = (
                torch.randn(4, in_f, generator=gen),
                torch.randn(out_f, 4, generator=gen),
            )
    path = write_adapter(tmp_path / "ours", weights, r=4, lora_alpha=8, base_model_name_or_path=str(base_path))
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert sorted(config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
    import copy

    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()
    (got,) = prompt_logprobs(engine_for(ours, tokenizer), [PROMPT], [LoRARequest("ours", str(path))])
    torch.testing.assert_close(got, reference(model, PROMPT), atol=1e-4, rtol=0)
    back = read_adapter(path)
    for name, (a, b) in weights.items():
        torch.testing.assert_close(back.weights[name][0], a)
        torch.testing.assert_close(back.weights[name][1], b)


def _edit_config(path, **changes):
    file = path / "adapter_config.json"
    config = json.loads(file.read_text()) | changes
    file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(bias="all"), "bias"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "not LoRA"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "embeddings or the head"),
    ],
)
def test_settings_we_cannot_apply_are_refused(base, tmp_path, change, message):
    hf, _, ours = base
    _, path = peft_adapter(hf, tmp_path / "a", seed=4, targets=["q_proj"])
    _edit_config(path, **change)
    with pytest.raises(AdapterError, match=message):
        read_adapter(path, ours.config, 16)


def test_an_embedding_adapter_is_refused_by_its_tensor(base, tmp_path):
    hf, _, ours = base
    _, path = peft_adapter(hf, tmp_path / "a", seed=5, targets=["q_proj", "embed_tokens"])
    _edit_config(path, target_modules=["q_proj"])  # only the tensors tell
    with pytest.raises(AdapterError, match="embedding"):
        read_adapter(path, ours.config, 16)


def test_shapes_names_and_ranks_are_checked_against_the_model(base, tmp_path, tokenizer):
    hf, _, ours = base
    _, path = peft_adapter(hf, tmp_path / "a", seed=6, r=8, targets=["q_proj", "o_proj"])
    with pytest.raises(AdapterError, match="rank 8 > max_lora_rank 4"):
        read_adapter(path, ours.config, 4)
    wrong = {"model.layers.0.self_attn.q_proj": (torch.zeros(4, 32), torch.zeros(64, 4))}
    bad = write_adapter(tmp_path / "shape", wrong, 4, 8, None)
    with pytest.raises(AdapterError, match=r"needs \[r, 64\] and \[64, r\]"):
        read_adapter(bad, ours.config, 16)
    deep = write_adapter(
        tmp_path / "deep", {"model.layers.7.self_attn.q_proj": (torch.zeros(4, 64), torch.zeros(64, 4))}, 4, 8, None
    )
    with pytest.raises(AdapterError, match="has no model.layers.7"):
        read_adapter(deep, ours.config, 16)
    # through the engine: refused at add_request, nothing queued, no KV block taken
    engine = engine_for(ours, tokenizer, max_lora_rank=4)
    free = engine.kv_cache_manager.num_free_blocks
    for path_ in (path, bad, deep, tmp_path / "missing"):
        with pytest.raises(AdapterError):
            engine.add_request(PROMPT, SamplingParams(max_tokens=2), lora_request=LoRARequest("x", str(path_)))
        engine.lora_manager.registered.clear()
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_free_blocks == free
    assert engine.lora_manager.slots.nbytes == 0  # no slot was allocated either
