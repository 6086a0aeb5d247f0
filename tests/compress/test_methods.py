"""Methods through compress(): SmoothQuant's exact transform, GPTQ <= RTN, AWQ, LLM.int8(), recipes."""

import dataclasses

import pytest
import torch

from leanlm.compress import (
    AWQConfig,
    FP8Config,
    GPTQConfig,
    LLMInt8Config,
    RTNConfig,
    SmoothQuantConfig,
    compress,
)
from leanlm.compress.calibration import LayerRunner
from leanlm.compress.quantize.gptq import gptq_quantize, layer_error
from leanlm.compress.transform.awq import search_block_scales, search_scales
from leanlm.compress.transform.smoothquant import smoothing_scales
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.llama import LinearGroup
from leanlm.model.quantized.numerics import fake_quantize, sqnr_db
from tests.compress.conftest import dense_logits


def _spiky(model):
    """Give the tiny model real-LLM-like activation outliers: a few norm channels 30x larger."""
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = norm.weight.detach().clone()
            w[[5, 17]] *= 30
            norm.weight = torch.nn.Parameter(w, requires_grad=False)
    return model


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_smoothquant_transform_leaves_outputs_unchanged(tiny_model, calib, heads, kv_heads):
    model = _spiky(tiny_model(torch.float64, heads=heads, kv_heads=kv_heads))
    before = dense_logits(model, calib)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    report = compress(model, [SmoothQuantConfig(alpha=0.5)], calib, progress=False)
    assert report.linears == []
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norm_before)  # it did move scales
    assert torch.allclose(dense_logits(model, calib), before, atol=1e-5, rtol=0)
    if heads == kv_heads:  # without GQA, v_proj -> o_proj is smoothed too
        assert all(isinstance(m, torch.nn.Linear) for m in model.modules() if hasattr(m, "in_features"))


def test_smoothquant_makes_w8a8_better_on_outlier_activations(tiny_model, calib):
    errors = {}
    for name, recipe in {
        "plain": [RTNConfig(bits=8, act_bits=8)],
        "smooth": [SmoothQuantConfig(alpha=0.5), RTNConfig(bits=8, act_bits=8)],
    }.items():
        model = _spiky(tiny_model(torch.float64))
        ref = dense_logits(model, calib)
        compress(model, recipe, calib, progress=False)
        errors[name] = sqnr_db(ref, dense_logits(model, calib))
    assert errors["smooth"] > errors["plain"] + 3


def test_smoothing_scales_formula():
    a, w = torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 2.0])
    s = smoothing_scales(a, w, 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))  # sqrt(a / w); inactive channel keeps 1


@pytest.mark.parametrize("bits,group_size", [(4, 64), (3, 32), (4, None), (8, None)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("shrink", [False, True])
def test_gptq_layer_error_is_at_most_rtn(bits, group_size, act_order, shrink):
    gen = torch.Generator().manual_seed(bits)
    k = 128
    x = torch.randn(2048, k, generator=gen) @ (torch.randn(k, k, generator=gen) / k**0.5)  # correlated inputs
    x[:, :4] *= 10
    w = torch.randn(64, k, generator=gen) / k**0.5
    hessian = 2 * x.t() @ x / x.shape[0]
    cfg = GPTQConfig(bits=bits, group_size=group_size, act_order=act_order and bits <= 4, shrink_search=shrink)
    result = gptq_quantize(w, hessian, cfg)
    rtn = fake_quantize(w, cfg.spec(k))
    gptq_err, rtn_err = layer_error(w, result.dequantized, hessian), layer_error(w, rtn, hessian)
    assert gptq_err <= rtn_err
    if bits <= 4:
        assert gptq_err < 0.8 * rtn_err  # a real improvement, not a tie
    # the codes + parameters it returns reproduce the dequantized weight exactly
    from leanlm.compress.quantize.int_scheme import build_module

    module = build_module(result.codes, result.qparams, cfg, None, result.perm)
    assert torch.allclose(module.dequantized_weight(), result.dequantized, atol=1e-5)


@pytest.mark.parametrize("true_sequential", [False, True])
def test_gptq_through_compress_beats_rtn_per_layer(tiny_model, calib, true_sequential):
    reports = {}
    for cfg in (RTNConfig(bits=3, group_size=32), GPTQConfig(bits=3, group_size=32, true_sequential=true_sequential)):
        model = tiny_model()
        reports[cfg.name] = {r.name: r.rel_error for r in compress(model, [cfg], calib, progress=False).linears}
        assert all(isinstance(model.get_submodule(n), RuntimeLinear) for n in reports[cfg.name])
    assert reports["gptq"].keys() == reports["rtn"].keys() and len(reports["rtn"]) == 14
    better = sum(reports["gptq"][n] <= reports["rtn"][n] for n in reports["rtn"])
    assert better >= 12  # per linear, on the layer's own calibration inputs
    assert sum(reports["gptq"].values()) < sum(reports["rtn"].values())


def test_observing_one_group_stops_early_and_sees_what_the_full_pass_sees(tiny_model, calib):
    from leanlm.compress.calibration import observe_inputs

    model = tiny_model(torch.float64)
    layer = model.model.layers[0]
    runner = LayerRunner(model, calib.shape[1], 2)
    hidden = model.model.embed_tokens(calib)
    full = observe_inputs(layer, runner, hidden, frozenset({"hessian"}))
    calls = []
    layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: calls.append(1))
    for group in layer.linear_groups:
        one = observe_inputs(layer, runner, hidden, frozenset({"hessian"}), (group,))
        ((name, fed),) = one.items()
        assert torch.allclose(fed.hessian, full[name].hessian, atol=1e-10) and fed.num_tokens == full[name].num_tokens
    assert len(calls) == 2  # down_proj ran only when its own group was observed (2 chunks of 2 samples)


def test_true_sequential_gptq_fits_o_proj_to_the_quantized_attention(tiny_model, calib):
    """The two schemes differ exactly from o_proj on: q/k/v see the same inputs either way."""
    weights = {}
    for seq in (False, True):
        model = tiny_model()
        compress(model, [GPTQConfig(bits=3, group_size=32, true_sequential=seq)], calib, progress=False)
        attn = model.model.layers[0].self_attn
        weights[seq] = (attn.q_proj.dequantized_weight(), attn.o_proj.dequantized_weight())
    assert torch.equal(weights[False][0], weights[True][0])
    assert not torch.equal(weights[False][1], weights[True][1])


def test_awq_scale_search_protects_salient_channels():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen)
    x[:, :6] *= 20  # salient input channels
    w = torch.randn(64, 128, generator=gen) / 128**0.5
    cfg = AWQConfig(bits=3, group_size=64)
    s = search_scales([w], x, x.abs().mean(0), cfg)
    ref = x @ w.t()
    rtn = x @ fake_quantize(w, cfg.spec(128)).t()
    awq = x @ (fake_quantize(w * s, cfg.spec(128)) / s).t()
    assert sqnr_db(ref, awq) > sqnr_db(ref, rtn) + 1
    assert s[:6].mean() > s[6:].mean()


def test_awq_then_rtn_beats_rtn_on_model(tiny_model, calib):
    out = {}
    for name, recipe in {
        "rtn": [RTNConfig(bits=3, group_size=32)],
        "awq": [AWQConfig(bits=3, group_size=32), RTNConfig(bits=3, group_size=32)],
    }.items():
        model = _spiky(tiny_model())
        ref = dense_logits(model, calib)
        compress(model, recipe, calib, progress=False)
        out[name] = sqnr_db(ref, dense_logits(model, calib))
    assert out["awq"] > out["rtn"]


def test_awq_inspects_the_block_a_group_feeds(tiny_model):
    blocks = {g.linears: g.block for g in tiny_model().model.layers[0].linear_groups}
    assert blocks[("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")] == "self_attn"
    assert blocks[("mlp.gate_proj", "mlp.up_proj")] == "mlp"
    assert blocks[("mlp.down_proj",)] == "mlp.down_proj"
    with pytest.raises(ValueError, match="block"):
        LinearGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj"))


def test_run_module_pieces_make_the_layer(tiny_model, calib):
    """The runner's submodule calls (attention with its context, the MLP) rebuild the layer's own output."""
    model = tiny_model(torch.float64)
    layer = model.model.layers[0]
    runner = LayerRunner(model, calib.shape[1], 2)
    h = model.model.embed_tokens(calib)  # [S, T, d]
    h = h + runner.run_module(layer, layer.self_attn, layer.input_layernorm(h))
    h = h + runner.run_module(layer, layer.mlp, layer.post_attention_layernorm(h))
    assert torch.allclose(h, runner(layer, model.model.embed_tokens(calib)), atol=1e-10, rtol=0)


@pytest.mark.parametrize("duo", [False, True])
def test_awq_block_search_beats_plain_rounding_on_the_attention_output(tiny_model, calib, duo):
    model = _spiky(tiny_model())
    layer = model.model.layers[0]
    runner = LayerRunner(model, calib.shape[1], calib.shape[0])
    x = layer.input_layernorm(model.model.embed_tokens(calib))  # [S, T, d]: what feeds q/k/v
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    cfg = AWQConfig(bits=3, group_size=32, duo_scaling=duo)
    before = [lin.weight for lin in linears]
    copies = [w.detach().clone() for w in before]
    block = lambda: runner.run_module(layer, layer.self_attn, x)
    ref = block()
    s = search_block_scales(linears, block, x.abs().mean(dim=(0, 1)), cfg)
    assert all(torch.equal(lin.weight, w) for lin, w in zip(linears, copies))  # the search restores the weights

    def loss(scales):
        for lin, w in zip(linears, before):
            lin.weight = torch.nn.Parameter(fake_quantize(w * scales, cfg.spec(w.shape[1])) / scales)
        out = (block() - ref).pow(2).mean().item()
        for lin, w in zip(linears, before):
            lin.weight = w
        return out

    assert loss(s) < 0.9 * loss(torch.ones_like(s))  # spiky channels: a real gain over plain rounding
    assert s[[5, 17]].min() > s.median()  # by scaling up the salient channels


def test_llm_int8_finds_outlier_columns_from_calibration(tiny_model, calib):
    model = _spiky(tiny_model())
    compress(model, [LLMInt8Config(threshold=6.0)], calib, progress=False)
    q = model.model.layers[0].self_attn.q_proj
    assert {5, 17} <= set(q.outlier_idx.tolist())


def test_recipes_validate_and_record_themselves(tiny_model, calib):
    model = tiny_model()
    with pytest.raises(ValueError, match="calibration"):
        compress(model, [GPTQConfig(bits=4)], None, progress=False)
    with pytest.raises(TypeError, match="method config"):
        compress(model, ["gptq"], calib, progress=False)
    from leanlm.train.act_sparse import TEALTrainConfig
    from leanlm.train.sparse import GMPConfig

    for training in (GMPConfig(sparsity=0.5), TEALTrainConfig()):  # their masks are learned over training steps
        with pytest.raises(ValueError, match=f"is a training method.*`leanlm train --recipe {training.name}`"):
            compress(model, [training], calib, progress=False)
    with pytest.raises(ValueError, match="empty"):
        compress(model, [], calib, progress=False)
    with pytest.raises(ValueError, match="token ids"):
        compress(model, [RTNConfig(bits=8, group_size=None)], torch.randn(2, 8), progress=False)
    with pytest.raises(ValueError, match="group_size"):
        RTNConfig(bits=4, group_size=48)
    with pytest.raises(ValueError, match="symmetric=True"):  # signed int8 storage has no zero point
        RTNConfig(bits=6, group_size=None, symmetric=False)
    report = compress(
        model,
        [
            FP8Config(),
        ],
        None,
        progress=False,
    )
    assert report.recipe[0]["method"] == "fp8" and not hasattr(model, "compression_recipe")
    assert isinstance(model.lm_head, torch.nn.Linear)  # lm_head ignored by default


def test_quantizing_the_head_unties_it(tiny_model):
    model = tiny_model()
    embed = model.model.embed_tokens.weight.clone()
    compress(model, [RTNConfig(bits=8, group_size=None, ignore=())], None, progress=False)
    assert isinstance(model.lm_head, RuntimeLinear)
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert dataclasses.is_dataclass(RTNConfig())
