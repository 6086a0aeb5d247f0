"""MoEfication: the experts partition the FFN (top-k = E is the dense model), balanced k-means gives equal experts,
the router predicts the experts the FFN uses, the MoE saves and loads back, and what cannot convert says why."""

from __future__ import annotations

import json
import re

import pytest
import torch

from leanlm.compress import MoefyConfig, RTNConfig, compress
from leanlm.compress.transform.expert_split import balanced_assign, balanced_kmeans, split_neurons
from leanlm.compress.transform.moefy import oracle_routing, ridge_router, set_top_k
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.llm import load_model
from leanlm.model.moe import SparseMoeBlock
from tests.compress.conftest import dense_logits


@pytest.mark.parametrize("split", ["weight", "coactivation"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_all_experts_on_is_the_dense_model(tiny_model, calib, split, architecture):
    model = tiny_model(torch.float64, architecture=architecture)  # intermediate 128
    before = dense_logits(model, calib[:2])
    compress(model, [MoefyConfig(num_experts=4, top_k=4, split=split)], calib, progress=False)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.moe.scoring == "ones"
    assert model.config.moe.num_experts == 4 and model.config.moe.expert_intermediate_size == 32
    assert [e.gate_proj.weight.shape for e in block.experts] == [(32, 64)] * 4
    assert block.gate.weight.dtype == torch.float64
    assert torch.allclose(dense_logits(model, calib[:2]), before, atol=1e-5, rtol=0)
    set_top_k(model, 2)  # half the experts: no longer the dense model
    assert model.config.moe.top_k == 2 and block.moe.top_k == 2
    assert not torch.allclose(dense_logits(model, calib[:2]), before, atol=1e-3)


def test_a_shared_expert_runs_on_every_token_and_all_on_is_still_dense(tiny_model, calib):
    model = tiny_model(torch.float64)
    before = dense_logits(model, calib[:2])
    compress(model, [MoefyConfig(num_experts=4, top_k=4, shared_neurons=32)], calib, progress=False)
    block = model.model.layers[0].mlp
    assert model.config.moe.shared_expert_intermediate_size == 32 and model.config.moe.expert_intermediate_size == 24
    assert block.shared_expert.gate_proj.weight.shape == (32, 64) and block.shared_expert_gate is None
    assert torch.allclose(dense_logits(model, calib[:2]), before, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="less 30 shared neurons does not split into 4"):
        compress(tiny_model(), [MoefyConfig(num_experts=4, top_k=1, shared_neurons=30)], calib, progress=False)


def test_experts_hold_the_ffn_neurons_once_each(tiny_model, calib):
    model = tiny_model(torch.float64)
    dense = model.model.layers[1].mlp
    gate, up, down = (dense.gate_proj.weight.clone(), dense.up_proj.weight.clone(), dense.down_proj.weight.clone())
    compress(model, [MoefyConfig(num_experts=8, top_k=2)], calib, progress=False)
    experts = model.model.layers[1].mlp.experts
    rows = torch.cat([e.gate_proj.weight for e in experts])
    order = [int((gate == r).all(1).nonzero()) for r in rows]  # each expert row's place in the dense gate
    assert sorted(order) == list(range(128))
    assert torch.equal(torch.cat([e.up_proj.weight for e in experts]), up[order])
    assert torch.equal(torch.cat([e.down_proj.weight for e in experts], dim=1), down[:, order])


def test_balanced_kmeans_makes_equal_clusters_and_finds_separated_ones():
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 8, generator=gen) * 10
    points = torch.cat([c + 0.1 * torch.randn(6, 8, generator=gen) for c in centres])  # 4 blobs of 6
    labels = balanced_kmeans(points, 4, seed=3)
    assert torch.bincount(labels).tolist() == [6, 6, 6, 6]
    for blob in labels.view(4, 6):
        assert len(set(blob.tolist())) == 1  # each blob one cluster
    # when every point prefers cluster 0, the size limit still holds and the most decided points get it
    cost = torch.tensor([[0.0, 5.0], [0.0, 1.0], [0.0, 9.0], [0.0, 2.0]])
    assert balanced_assign(cost, 2).tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="equal clusters"):
        balanced_kmeans(points[:23], 4)


def test_coactivation_split_groups_neurons_that_fire_together():
    gen = torch.Generator().manual_seed(0)
    family = torch.arange(40) % 4  # 4 families of 10 neurons; a token of family f fires 4 of f's neurons
    token_family = torch.arange(200) % 4
    acts = 0.1 * torch.rand(200, 40, generator=gen, dtype=torch.float64)  # the rest: small, never exactly 0
    for t, f in enumerate(token_family.tolist()):
        members = torch.nonzero(family == f).flatten()
        acts[t, members[torch.randperm(10, generator=gen)[:4]]] += 1.0
    weights = torch.randn(40, 8, generator=gen)  # the weight split knows nothing of the families
    groups = split_neurons("coactivation", 4, weights, acts, iters=15, seed=0)
    assert sorted(tuple(set((g % 4).tolist())) for g in groups) == [(0,), (1,), (2,), (3,)]
    by_weight = split_neurons("weight", 4, weights, acts, iters=15, seed=0)
    assert any(len(set((g % 4).tolist())) > 1 for g in by_weight)


def test_ridge_router_recovers_a_linear_map_and_predicts_the_used_experts(tiny_model, calib):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(500, 12, generator=gen, dtype=torch.float64), torch.randn(3, 12, generator=gen)
    assert torch.allclose(ridge_router(x, x @ w.double().T, 0.0), w.double(), atol=1e-8)
    model = tiny_model(torch.float64)
    report = compress(model, [MoefyConfig(num_experts=8, top_k=2)], calib, progress=False)
    stats = report.details["moefy"]
    assert stats["router recall of oracle top-k"] > 2 / 8 + 0.15  # well above a random pick of 2 of 8
    assert stats["activation mass kept (oracle)"] >= stats["activation mass kept (router)"] > 2 / 8


def test_oracle_routing_loses_less_than_the_router_and_restores_it(tiny_model, calib):
    model = tiny_model(torch.float64)
    dense = dense_logits(model, calib)
    compress(model, [MoefyConfig(num_experts=8, top_k=3, router="centroid", split="weight")], progress=False)
    routed = (dense_logits(model, calib) - dense).pow(2).mean()
    gates, keys = [layer.mlp.gate for layer in model.model.layers], set(model.state_dict())
    with oracle_routing(model):
        oracle = (dense_logits(model, calib) - dense).pow(2).mean()
        assert set(model.state_dict()) == keys - {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    assert oracle < routed
    assert [layer.mlp.gate for layer in model.model.layers] == gates


def test_the_moefied_model_saves_loads_and_quantizes_its_experts(tmp_path, tiny_model, calib, tokenizer):
    model = tiny_model()
    compress(model, [MoefyConfig(num_experts=4, top_k=2)], calib, progress=False)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["leanlm_moe"]["num_experts"] == 4 and saved["leanlm_moe"]["scoring"] == "ones"
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config.moe == model.config.moe
    with torch.inference_mode():
        assert torch.allclose(dense_logits(loaded, calib[:2]), dense_logits(model, calib[:2]), atol=1e-5)
    # a quantizer after it sees every expert as its own group; the router stays float
    report = compress(
        tiny_model(), [MoefyConfig(num_experts=4, top_k=2), RTNConfig(bits=8, group_size=None)], calib, progress=False
    )
    names = {r.name for r in report.linears}
    assert "model.layers.0.mlp.experts.3.down_proj" in names and not any(n.endswith("mlp.gate") for n in names)


def test_what_cannot_convert_says_what_to_do(tiny_model, calib):
    with pytest.raises(ValueError, match="does not split into 5 equal experts"):
        compress(tiny_model(), [MoefyConfig(num_experts=5, top_k=1)], calib, progress=False)
    quantized = tiny_model()
    compress(quantized, [RTNConfig(bits=8)], progress=False)
    with pytest.raises(ValueError, match="before any quantizer"):
        compress(quantized, [MoefyConfig(num_experts=4, top_k=1)], calib, progress=False)
    with pytest.raises(ValueError, match="need calibration samples"):
        compress(tiny_model(), [MoefyConfig(num_experts=4, top_k=1)], progress=False)
    moe = tiny_model()
    compress(moe, [MoefyConfig(num_experts=4, top_k=1)], calib, progress=False)
    with pytest.raises(ValueError, match="already has experts"):
        compress(moe, [MoefyConfig(num_experts=2, top_k=1)], calib, progress=False)
    with pytest.raises(ValueError, match="top_k must be in"):
        MoefyConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="split must be one of"):
        MoefyConfig(split="random")
    with pytest.raises(ValueError, match="top_k must be in"):
        set_top_k(tiny_model(), 2)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--experts", "4", "--top-k", "5"], "top_k must be in"),
        (["--calib", "/no/such/file"], "does not exist"),
        (["--shared-neurons", "-1"], "shared_neurons must be >= 0"),
    ],
)
def test_the_command_refuses_bad_input_before_loading(argv, message, capsys, tmp_path):
    from leanlm.cli import main

    assert main(["moefy", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.real_model
def test_the_command_moefies_the_real_model_and_it_loads_as_the_dense_one(tmp_path, capsys):
    """`leanlm moefy` on SmolLM2 with every expert on, loaded back by LLM's loader, against the dense model in
    float32 (its weights rounded to bfloat16, as the checkpoint stores them). The experts' outputs are summed one
    by one instead of inside one GEMM: float32 rounding (2^-24 relative per addition, on FFN outputs of size ~10 in
    a residual stream of ~100, over 30 layers) stays far below 2e-3, while routing to fewer experts moves logits
    by more than 0.1 (checked last)."""
    from leanlm.cli import main
    from leanlm.compress import calibration_samples, read_calibration_text
    from leanlm.formats import load_checkpoint
    from leanlm.loading.registry import DEFAULT_MODEL

    out = tmp_path / "moe"
    argv = ["moefy", "--experts", "8", "--top-k", "8", "--num-samples", "4", "--seq-len", "64", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out  # every expert on: the held-out perplexity is the dense model's
    assert re.search(r"quality check: WikiText-2 perplexity .* \([+-]0\.0%\)", printed) and "WARNING" not in printed
    dense = load_checkpoint(DEFAULT_MODEL, "float32", progress=False)
    with torch.no_grad():  # the command saves bfloat16 weights (as `leanlm quantize` does): the same rounding here
        for param in dense.model.parameters():
            param.copy_(param.bfloat16().float())
    moe = load_model(str(out), progress=False)
    assert moe.config.moe.num_experts == 8 and isinstance(moe.model.layers[29].mlp, SparseMoeBlock)
    text = read_calibration_text()[-4000:]  # not the windows the router saw
    ids = calibration_samples(dense.tokenizer.encode(text, add_special_tokens=False), 2, 48, seed=1)
    with torch.inference_mode():
        want, got = dense_logits(dense.model, ids), dense_logits(moe, ids)
        assert (got - want).abs().max() < 2e-3
        set_top_k(moe, 2)
        assert (dense_logits(moe, ids) - want).abs().max() > 0.1
