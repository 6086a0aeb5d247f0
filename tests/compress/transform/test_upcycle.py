"""Sparse upcycling and PR-MoE: the upcycled model computes the dense one's logits (float64 tiny llama, float32
SmolLM2), saves as Mixtral (HF's MixtralForCausalLM loads it with the same logits) or as llama + leanlm_moe, and
loads back through leanlm.formats / LLM(path); what cannot be upcycled says what to do."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from leanlm.compress import RTNConfig, UpcycleConfig, compress
from leanlm.compress.transform.upcycle import upcycled_block
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.hf_dir import load_hf_dir
from leanlm.llm import LLM, load_model
from leanlm.model.llama import build_model
from leanlm.model.moe import SparseMoeBlock
from leanlm.sampling_params import SamplingParams
from tests.compress.conftest import dense_logits

VARIANTS = {
    "upcycle": UpcycleConfig(num_experts=4, top_k=2),
    "upcycle_top3": UpcycleConfig(num_experts=5, top_k=3, seed=3),
    "pr_moe_zero": UpcycleConfig(num_experts=4, residual=True),
    "pr_moe_half": UpcycleConfig(num_experts=4, residual=True, residual_init="half"),
    "every_other": UpcycleConfig(num_experts=3, layers=(1,)),
}


def _experts_used(model) -> list[int]:
    """Per sparse layer, how many experts ran on some token."""
    return [sum(1 for c in layer.mlp.stats.load if c) for layer in model.model.layers if hasattr(layer.mlp, "stats")]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_upcycled_model_equals_the_dense_one(tiny_model, calib, variant):
    cfg = VARIANTS[variant]
    model = tiny_model(torch.float64)
    before = dense_logits(model, calib)
    report = compress(model, [cfg], progress=False)
    assert report.linears == [] and report.recipe[0]["method"] == "upcycle"
    moe = model.config.moe
    assert moe.num_experts == cfg.num_experts and moe.top_k == cfg.experts_per_token
    assert moe.scoring == ("softmax" if variant == "pr_moe_zero" else "softmax_renorm")
    assert moe.router_aux_loss_coef == 0.01 and moe.shared_expert_gate is False
    assert moe.shared_expert_intermediate_size == (128 if cfg.residual else 0)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == ([False, True] if cfg.layers else [True, True])
    assert dense_logits(model, calib).sub(before).abs().max() < 1e-5
    # the random routers spread the tokens: the equality holds whichever experts a token goes to
    assert all(used > moe.top_k for used in _experts_used(model))
    groups = [g.linears[0] for g in model.model.layers[1].linear_groups]
    assert "mlp.experts.0.gate_proj" in groups and ("mlp.shared_expert.gate_proj" in groups) == cfg.residual


def test_pr_moe_initialisations_preserve_the_dense_mlp_differently(tiny_model):
    model = tiny_model(torch.float64)
    mlp = model.model.layers[0].mlp
    config = model.config
    for init, shared_scale, expert_scale in (("zero", 1.0, 0.0), ("half", 0.5, 0.5)):
        cfg = UpcycleConfig(num_experts=2, residual=True, residual_init=init)
        up = dataclasses.replace(config, moe=cfg.moe_config(128, 2))
        block = upcycled_block(mlp, up, cfg, torch.Generator().manual_seed(0))
        assert torch.equal(block.shared_expert.down_proj.weight, mlp.down_proj.weight * shared_scale)
        assert torch.equal(block.experts[1].down_proj.weight, mlp.down_proj.weight * expert_scale)
        assert torch.equal(block.experts[1].gate_proj.weight, mlp.gate_proj.weight)
        # copies, not views: training one expert leaves the others and the dense weight alone
        assert block.experts[0].gate_proj.weight.data_ptr() != block.experts[1].gate_proj.weight.data_ptr()
        assert block.experts[0].gate_proj.weight.data_ptr() != mlp.gate_proj.weight.data_ptr()


@pytest.mark.parametrize("init,learns", [("zero", True), ("half", False)])
def test_a_pr_moe_router_learns_from_the_next_token_loss_only_with_switch_gates(tiny_model, calib, init, learns):
    """Top-1 weights renormalised over one expert are always 1: the router gets no gradient from the LM loss."""
    from leanlm.model.forward import causal_lm_loss

    model = tiny_model(torch.float64)
    compress(model, [UpcycleConfig(num_experts=4, residual=True, residual_init=init)], progress=False)
    with torch.no_grad():  # experts that have trained apart from the dense MLP
        for layer in model.model.layers:
            for expert in layer.mlp.experts:
                expert.down_proj.weight.normal_(0, 0.1)
    model.train().requires_grad_(True)
    causal_lm_loss(model, calib[:2]).backward()
    grad = max(float(layer.mlp.gate.weight.grad.abs().max()) for layer in model.model.layers)
    assert (grad > 1e-4) == learns and (grad < 1e-6 or learns)  # 1e-6: float32 rounding of the weights


def test_router_init_is_small_and_seeded(tiny_model):
    weights = []
    for seed in (0, 0, 1):
        model = tiny_model()
        compress(model, [UpcycleConfig(num_experts=4, seed=seed)], progress=False)
        weights.append(model.model.layers[0].mlp.gate.weight.detach().clone())
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    assert abs(float(weights[0].std()) / (0.1 / 64) ** 0.5 - 1) < 0.2  # Switch's sqrt(0.1 / hidden)


def test_upcycled_llama_saves_as_mixtral_that_hf_loads_with_the_same_logits(tmp_path, tiny_model, calib, tokenizer):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(torch.float64)
    ids = calib[0]
    before = dense_logits(model, ids[None])[0]
    compress(model, [UpcycleConfig(num_experts=4, top_k=2)], progress=False)
    assert model.config.architecture == "mixtral"
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float64)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 4 and saved["num_experts_per_tok"] == 2
    assert saved["router_aux_loss_coef"] == 0.01
    hf = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(theirs, before, atol=1e-5, rtol=0)
    config, state = load_hf_dir(tmp_path, dtype=torch.float64, progress=False)  # Mixtral's w1/w3/w2 names back
    assert config.moe == model.config.moe
    with torch.inference_mode():
        loaded = dense_logits(build_model(config, state, torch.float64), ids[None])[0]
    torch.testing.assert_close(loaded, before, atol=1e-5, rtol=0)
    assert load_model(str(tmp_path), progress=False).config.architecture == "mixtral"


def test_pr_moe_saves_as_llama_with_its_moe_block_and_llm_serves_it(tmp_path, tiny_model, calib, tokenizer):
    model = tiny_model(torch.float64)
    before = dense_logits(model, calib[:2])
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path / "dense", dtype=torch.float32)
    compress(model, [UpcycleConfig(num_experts=4, residual=True, router_aux_loss_coef=0.02)], progress=False)
    assert model.config.architecture == "llama"
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path / "moe", dtype=torch.float32)
    block = json.loads((tmp_path / "moe" / "config.json").read_text())["leanlm_moe"]
    assert block["shared_expert_intermediate_size"] == 128 and block["top_k"] == 1
    assert block["router_aux_loss_coef"] == 0.02
    loaded = load_model(str(tmp_path / "moe"), progress=False)
    assert loaded.config.moe == model.config.moe
    with torch.inference_mode():
        assert dense_logits(loaded, calib[:2]).sub(before.float()).abs().max() < 1e-4
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [calib[0, :9].tolist(), calib[1, :5].tolist()]
    moe_out = LLM(str(tmp_path / "moe"), dtype="float32").generate(prompts, greedy, use_tqdm=False)
    dense_out = LLM(str(tmp_path / "dense"), dtype="float32").generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in moe_out] == [o.outputs[0].token_ids for o in dense_out]


def test_qwen2_keeps_its_architecture_and_save_as_source_keeps_llama(tiny_model, calib):
    qwen = tiny_model(torch.float64, architecture="qwen2")
    before = dense_logits(qwen, calib[:2])
    compress(qwen, [UpcycleConfig(num_experts=2)], progress=False)  # auto: Mixtral has no q/k/v bias
    assert qwen.config.architecture == "qwen2" and qwen.config.moe is not None
    assert dense_logits(qwen, calib[:2]).sub(before).abs().max() < 1e-5
    llama = tiny_model()
    compress(llama, [UpcycleConfig(num_experts=2, save_as="source")], progress=False)
    assert llama.config.architecture == "llama"


def test_what_cannot_be_upcycled_says_what_to_do(tiny_model):
    quantized = tiny_model()
    compress(quantized, [RTNConfig(bits=8)], progress=False)
    with pytest.raises(ValueError, match="before any quantizer"):
        compress(quantized, [UpcycleConfig()], progress=False)
    moe = tiny_model()
    compress(moe, [UpcycleConfig(num_experts=2)], progress=False)
    with pytest.raises(ValueError, match="mixture of experts already"):
        compress(moe, [UpcycleConfig()], progress=False)
    with pytest.raises(ValueError, match="cannot be saved as Mixtral"):
        compress(tiny_model(architecture="qwen2"), [UpcycleConfig(save_as="mixtral")], progress=False)
    with pytest.raises(ValueError, match="past the model"):
        compress(tiny_model(), [UpcycleConfig(layers=(5,))], progress=False)
    with pytest.raises(ValueError, match="shared expert"):
        UpcycleConfig(residual=True, save_as="mixtral")
    with pytest.raises(ValueError, match="top_k must be in"):
        UpcycleConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="residual_init"):
        UpcycleConfig(residual_init="random")
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        UpcycleConfig(router_aux_loss_coef=-1.0)
    assert UpcycleConfig(layers=[3, 1, 1]).layers == (1, 3)


@pytest.mark.real_model
def test_upcycled_smollm2_equals_the_dense_model(smollm, real_tokenizer):
    """float32: the 8 copies' weighted sum differs from one copy by the rounding of the two renormalised weights
    (|w1 + w2 - 1| <= 2^-23 each) and of the sum itself, ~1e-7 of each MLP output, and 30 layers carry it into
    logits of magnitude ~20: 2e-3 absolute is 1e-4 of their scale (a real routing bug moves them by whole units)."""
    ids = torch.tensor([real_tokenizer.encode("The Eiffel Tower is a wrought-iron lattice tower in Paris.")])
    model = build_model(smollm.config, smollm.state_dict, torch.float32)
    before = dense_logits(model, ids)
    compress(model, [UpcycleConfig(num_experts=8, top_k=2)], progress=False)
    after = dense_logits(model, ids)
    assert after.sub(before).abs().max() < 2e-3
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    pr = build_model(smollm.config, smollm.state_dict, torch.float32)
    compress(pr, [UpcycleConfig(num_experts=8, residual=True, layers=tuple(range(0, 30, 2)))], progress=False)
    assert dense_logits(pr, ids).sub(before).abs().max() < 2e-3
