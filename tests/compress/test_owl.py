"""OWL layer sparsities: the mapping from outlier ratios, the plan pass over the uncompressed model, and every
pruner pruning each layer to its planned fraction with the model's sparsity unchanged."""

import dataclasses

import pytest
import torch

from leanlm.compress import MagnitudeConfig, SparseGPTConfig, WandaConfig, compress
from leanlm.compress.base import build_method
from leanlm.compress.named_recipes import build_prune_recipe
from leanlm.compress.prune.owl import outlier_ratio, owl_sparsities
from leanlm.model.llama import build_model
from tests.compress.conftest import VOCAB
from tests.conftest import tiny_config, tiny_state_dict

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_owl_sparsities_keep_the_mean_and_prune_outlier_layers_least():
    ratios = [0.010, 0.030, 0.015, 0.020]
    sp = owl_sparsities(ratios, 0.5, 0.08)
    assert sum(sp) / len(sp) == pytest.approx(0.5)
    assert max(sp) - min(sp) == pytest.approx(0.16)  # the ratios span 2 lambda
    assert sorted(range(4), key=lambda i: sp[i]) == sorted(range(4), key=lambda i: -ratios[i])
    assert owl_sparsities([0.02, 0.02, 0.02], 0.7, 0.08) == [0.7, 0.7, 0.7]


def test_outlier_ratio_counts_scores_above_m_times_the_mean():
    scores = torch.tensor([1.0] * 98 + [100.0, 200.0])  # mean 3.98: two scores above 5 x mean
    assert outlier_ratio(scores, 5.0) == pytest.approx(0.02)
    assert outlier_ratio(scores, 60.0) == 0.0
    assert outlier_ratio(torch.zeros(0), 5.0) == 0.0


def test_profile_validation():
    with pytest.raises(ValueError, match="profile must be one of"):
        WandaConfig(profile="layerwise")
    with pytest.raises(ValueError, match="pattern 2:4 fixes it"):
        SparseGPTConfig(pattern="2:4", profile="owl")
    with pytest.raises(ValueError, match="at most 0.050"):
        WandaConfig(sparsity=0.1, profile="owl")
    with pytest.raises(ValueError, match="at most 0.075"):
        WandaConfig(sparsity=0.85, profile="owl")
    with pytest.raises(ValueError, match="owl_m"):
        WandaConfig(profile="owl", owl_m=0)
    with pytest.raises(ValueError, match="global threshold"):
        MagnitudeConfig(scope="global", profile="owl")
    with pytest.raises(ValueError, match="add --profile owl"):
        build_prune_recipe("wanda", 0.5, owl_lambda=0.05)
    with pytest.raises(ValueError, match="teal takes --allocation"):
        build_prune_recipe("teal", profile="owl")
    assert build_prune_recipe("sparsegpt", 0.6, profile="owl", owl_lambda=0.05)[0].owl_lambda == 0.05
    # OWL needs activations even for magnitude pruning, which otherwise needs none
    assert build_method(MagnitudeConfig()).needs == frozenset()
    assert build_method(MagnitudeConfig(profile="owl")).needs


def _three_layers_with_outliers_in_the_middle():
    cfg = dataclasses.replace(tiny_config(VOCAB), num_hidden_layers=3)
    sd = tiny_state_dict(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    for name in LINEARS:
        key = next(k for k in sd if k.startswith("model.layers.1.") and k.endswith(f"{name}.weight"))
        w = sd[key]
        spikes = torch.rand(w.shape, generator=gen) < 0.03  # 3% of layer 1's weights 30x larger
        sd[key] = torch.where(spikes, 30 * w, w)
    return build_model(cfg, sd, torch.float32)


def _layer_zeros(model) -> list[float]:
    out = []
    for layer in model.model.layers:
        weights = [m.weight for name, m in layer.named_modules() if name.split(".")[-1] in LINEARS]
        out.append(sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights))
    return out


@pytest.mark.parametrize(
    "config",
    [
        WandaConfig(sparsity=0.5, profile="owl", pack=False),
        SparseGPTConfig(sparsity=0.5, profile="owl", pack=False),
        MagnitudeConfig(sparsity=0.5, profile="owl", pack=False),
    ],
    ids=["wanda", "sparsegpt", "magnitude"],
)
def test_every_pruner_prunes_each_layer_to_its_owl_sparsity(config, calib):
    model = _three_layers_with_outliers_in_the_middle()
    report = compress(model, config, calib, progress=False)
    zeros = _layer_zeros(model)
    # layer 1 carries the outliers: least pruned, at the bottom of the range
    assert zeros[1] == min(zeros) < 0.45
    assert sum(zeros) / 3 == pytest.approx(0.5, abs=0.005)  # the model's sparsity is the target's
    assert max(zeros) - min(zeros) == pytest.approx(0.16, abs=0.01)
    summary = report.details[config.name]
    assert summary["OWL layer sparsity min"] == pytest.approx(min(zeros), abs=0.01)
    assert summary["OWL layer sparsity max"] == pytest.approx(max(zeros), abs=0.01)


def test_the_plan_sees_every_layer_uncompressed_before_any_is_pruned(calib):
    model = _three_layers_with_outliers_in_the_middle()
    method = build_method(WandaConfig(sparsity=0.5, profile="owl", pack=False))
    events = []
    plan_layer, apply_layer = method.plan_layer, method.apply_layer

    def record_plan(prefix, layer, inputs):
        dense = all(bool((m.weight != 0).all()) for m in layer.modules() if isinstance(m, torch.nn.Linear))
        events.append(("plan", prefix, dense))
        plan_layer(prefix, layer, inputs)

    def record_apply(layer, prefix, inputs):
        events.append(("apply", prefix, None))
        return apply_layer(layer, prefix, inputs)

    method.plan_layer, method.apply_layer = record_plan, record_apply
    from leanlm.compress.calibration import run_layers

    run_layers(model, [method], calib, progress=False)
    assert [e[:2] for e in events] == [("plan", f"model.layers.{i}") for i in range(3)] + [
        ("apply", f"model.layers.{i}") for i in range(3)
    ]
    assert all(e[2] for e in events[:3])  # every weight nonzero while planning


def test_uniform_profile_prunes_every_layer_alike(calib):
    model = _three_layers_with_outliers_in_the_middle()
    compress(model, WandaConfig(sparsity=0.5, pack=False), calib, progress=False)
    assert _layer_zeros(model) == pytest.approx([0.5, 0.5, 0.5], abs=0.005)


def test_sparsegpt_joint_quantization_follows_the_owl_plan(calib, monkeypatch):
    """The joint sweep chooses each layer's mask at the layer's planned fraction (quantization then rounds more
    weights to 0, so the zeros alone cannot tell)."""
    from leanlm.compress.prune import sparsegpt

    chosen, select = [], sparsegpt.sparsegpt_select
    monkeypatch.setattr(sparsegpt, "sparsegpt_select", lambda scheme: chosen.append(scheme.sparsity) or select(scheme))
    model = _three_layers_with_outliers_in_the_middle()
    report = compress(model, SparseGPTConfig(sparsity=0.5, profile="owl", bits=4), calib, progress=False)
    per_layer = [sorted(set(chosen[i : i + 7])) for i in range(0, 21, 7)]  # 7 linears a layer, in order
    assert len(chosen) == 21 and all(len(s) == 1 for s in per_layer)
    planned = [s[0] for s in per_layer]
    assert planned[1] == min(planned) == pytest.approx(report.details["sparsegpt"]["OWL layer sparsity min"])
    assert sum(planned) / 3 == pytest.approx(0.5)
