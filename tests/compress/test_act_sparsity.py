"""Activation sparsity (TEAL): thresholds calibrated per linear, the batch-size effect it reports, the greedy
allocation across a layer's linears, and the `leanlm prune --method teal` recipe."""

import pytest
import torch

from leanlm.compress import ActivationSparsityConfig, compress
from leanlm.compress.activation.act_sparsity import greedy_levels, rows_read, threshold_for
from leanlm.compress.named_recipes import build_prune_recipe
from leanlm.kernels import cpu_act_sparse
from leanlm.model.linear.act_sparse import ActSparseLinear

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_bad_settings_are_refused():
    for kw, message in [
        (dict(sparsity=1.0), "fraction"),
        (dict(allocation="best"), "allocation"),
        (dict(score="gradient"), "score"),
    ]:
        with pytest.raises(ValueError, match=message):
            ActivationSparsityConfig(**kw)


def test_threshold_and_rows_read():
    samples = torch.tensor([[0.1, -0.2, 0.3, -0.4], [0.5, 0.05, -0.6, 0.7]])
    assert threshold_for(samples, 0.25) == pytest.approx(0.1)  # 2 of 8 entries at or below 0.1
    assert threshold_for(samples, 0.0) == 0.0
    scores = samples.abs()
    assert rows_read(scores, 0.1, 1) == pytest.approx(6 / 8)
    assert rows_read(scores, 0.1, 2) == pytest.approx(1.0)  # column 0 and 1: each kept by one of the two rows


def test_greedy_steps_up_the_cheapest_error_per_byte():
    errors = {"a": [0.0, 0.1, 0.5, 2.0], "b": [0.0, 0.01, 0.02, 0.04]}
    levels = greedy_levels(errors, {"a": 100, "b": 100}, target=0.075)  # 3 steps of 5% over 200 bytes
    assert levels == {"a": 0, "b": 3}


@pytest.mark.parametrize("allocation", ["uniform", "greedy", "block"])
@pytest.mark.parametrize("score", ["magnitude", "weighted"])
def test_every_decoder_linear_sparsifies_its_share_of_calibration_inputs(tiny_model, calib, allocation, score):
    model = tiny_model()
    cfg = ActivationSparsityConfig(sparsity=0.4, allocation=allocation, score=score)
    report = compress(model, cfg, calib, progress=False)
    linears = [m for layer in model.model.layers for m in (*layer.self_attn.children(), *layer.mlp.children())]
    assert len(linears) == 14 and all(isinstance(m, ActSparseLinear) for m in linears)
    assert not isinstance(model.lm_head, ActSparseLinear)
    summary = report.details["act-sparsity"]
    reads = [summary[f"weight rows read at batch {b}"] for b in (1, 2, 4, 8, 16)]
    assert reads == sorted(reads) and reads[-1] <= 1  # more rows read as the batch grows
    if allocation == "uniform":
        assert reads[0] == pytest.approx(0.6, abs=0.01)
    else:  # the layer's bytes-weighted sparsity is the target; each kind's mean share is reported
        assert {f"{k} sparsity" for k in KINDS} <= set(summary)
    if score == "weighted":
        down = model.model.layers[0].mlp.down_proj
        torch.testing.assert_close(down.column_scale, down.dequantized_weight().norm(dim=0), rtol=1e-2, atol=0)


def test_compressed_model_output_moves_with_the_sparsity(tiny_model, calib):
    from tests.compress.conftest import dense_logits

    base = tiny_model(torch.float64)
    ref = dense_logits(base, calib)
    errors = []
    for sparsity in (0.0, 0.2, 0.5):
        model = tiny_model(torch.float64)
        compress(model, ActivationSparsityConfig(sparsity=sparsity), calib, progress=False)
        errors.append(float((dense_logits(model, calib) - ref).norm() / ref.norm()))
    assert errors[0] < 1e-12 < errors[1] < errors[2]


def test_teal_recipe_and_flags_that_do_not_apply():
    assert build_prune_recipe("teal") == [ActivationSparsityConfig(sparsity=0.4)]
    assert build_prune_recipe("teal", sparsity=0.25) == [ActivationSparsityConfig(sparsity=0.25)]
    with pytest.raises(ValueError, match="--pattern"):
        build_prune_recipe("teal", pattern="2:4")
    with pytest.raises(ValueError, match="--then-quantize"):
        build_prune_recipe("teal", then_quantize="rtn")
    assert build_prune_recipe("teal", allocation="block") == [
        ActivationSparsityConfig(sparsity=0.4, allocation="block")
    ]
    with pytest.raises(ValueError, match="--allocation"):
        build_prune_recipe("wanda", sparsity=0.5, allocation="block")


def test_the_kernel_path_and_the_pytorch_path_agree_on_a_compressed_layer(tiny_model, calib, monkeypatch):
    model = tiny_model(torch.bfloat16)
    compress(model, ActivationSparsityConfig(sparsity=0.4), calib, progress=False)
    down = model.model.layers[1].mlp.down_proj
    x = torch.randn(3, down.in_features).bfloat16()
    with torch.inference_mode():
        fast = down(x)
        monkeypatch.setattr(cpu_act_sparse, "is_available", lambda: False)
        slow = down(x)
    torch.testing.assert_close(fast.float(), slow.float(), rtol=2**-7, atol=1e-2)
