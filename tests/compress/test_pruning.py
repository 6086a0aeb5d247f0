"""Pruning: masks, magnitude / Wanda / SparseGPT as pure functions and through compress(), and zeros that
survive a quantizer later in the recipe."""

import pytest
import torch

from leanlm.compress import GPTQConfig, MagnitudeConfig, RTNConfig, SparseGPTConfig, WandaConfig, compress
from leanlm.compress.prune.magnitude import global_threshold
from leanlm.compress.prune.pruner import pack_semi_structured
from leanlm.compress.prune.sparsegpt import sparsegpt_prune
from leanlm.compress.prune.sparsity import SparsityScheme, lowest_mask, nm_mask, parse_pattern, satisfies_nm
from leanlm.compress.quantize.gptq import gptq_quantize, layer_error
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.sparsity_mask import pruned_mask
from tests.compress.conftest import dense_logits


def _weights(n=32, k=64, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _correlated_hessian(k=64, n=512, seed=1):
    """2 X^T X / n of inputs with strongly correlated channels and uneven scales (as LLM activations are)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k // 4, generator=g) @ torch.randn(k // 4, k, generator=g)
    x = x + 0.1 * torch.randn(n, k, generator=g)
    x = x * torch.linspace(0.2, 3.0, k)[torch.randperm(k, generator=g)]  # scales in no order (as in LLMs)
    return 2 * x.t() @ x / n, x


# ---------------------------------------------------------------------------------------------- masks


def test_scheme_validation_and_pattern_parsing():
    assert SparsityScheme().sparsity == 0.5
    assert SparsityScheme(pattern="2:4").sparsity == 0.5
    assert SparsityScheme(pattern="4:8").nm == (4, 8)
    assert SparsityScheme(pattern="1:4", sparsity=0.75).sparsity == 0.75
    assert parse_pattern("3:8") == (3, 8)
    for bad in ("2-4", "4:2", "0:4", "a:b", "2:4:8"):
        with pytest.raises(ValueError, match="pattern"):
            SparsityScheme(pattern=bad)
    with pytest.raises(ValueError, match="pass one of them"):
        SparsityScheme(pattern="2:4", sparsity=0.6)
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            SparsityScheme(sparsity=bad)
    with pytest.raises(ValueError, match="divisible by 4"):
        SparsityScheme(pattern="2:4").check_shape(6)


def test_lowest_mask_counts_per_row_and_per_matrix():
    scores = _weights().abs()
    per_row = lowest_mask(scores, 0.3, per_row=True)
    assert (per_row.sum(1) == int(0.3 * 64)).all()
    # every pruned score of a row is at most every kept one
    for r in range(scores.shape[0]):
        assert scores[r][per_row[r]].max() <= scores[r][~per_row[r]].min()
    whole = lowest_mask(scores, 0.3, per_row=False)
    assert whole.sum() == int(0.3 * scores.numel())
    assert scores[whole].max() <= scores[~whole].min()
    assert not whole.sum(1).eq(whole.sum(1)[0]).all()  # rows differ: the fraction holds over the matrix
    assert not lowest_mask(scores, 0.0, per_row=True).any()


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_keeps_the_n_largest_of_every_m(n, m):
    scores = _weights().abs()
    mask = nm_mask(scores, n, m)
    groups = mask.view(32, -1, m)
    assert (groups.sum(-1) == m - n).all()
    s = scores.view(32, -1, m)
    assert (s.masked_fill(~groups, -1).amax(-1) <= s.masked_fill(groups, float("inf")).amin(-1)).all()
    assert satisfies_nm(scores.masked_fill(mask, 0), n, m)
    assert not satisfies_nm(scores, n, m)


# ---------------------------------------------------------------------------------------------- SparseGPT


@pytest.mark.parametrize("pattern", [None, "2:4"])
def test_sparsegpt_with_a_flat_hessian_is_magnitude_pruning(pattern):
    # H = c I: no correlations to compensate through, and the OBS saliency w^2 / [H^-1]_ii ranks like |w|
    w = _weights()
    cfg = SparseGPTConfig(pattern=pattern, block_size=16, damp_percent=0.0)
    pruned = sparsegpt_prune(w, 3.0 * torch.eye(64), cfg)
    if pattern is None:  # the mask is chosen per block of 16 columns over all rows
        expected = torch.cat([lowest_mask(w[:, b : b + 16].abs(), 0.5, per_row=False) for b in range(0, 64, 16)], 1)
    else:
        expected = nm_mask(w.abs(), 2, 4)
    assert torch.equal(pruned == 0, expected)
    assert torch.allclose(pruned[~expected], w[~expected], atol=1e-6)


def test_sparsegpt_beats_magnitude_and_wanda_on_the_layer_objective():
    w = _weights()
    h, x = _correlated_hessian()
    for pattern in (None, "2:4"):
        scheme = SparsityScheme(pattern=pattern)
        errors = {
            "sparsegpt": layer_error(w, sparsegpt_prune(w, h, SparseGPTConfig(pattern=pattern, block_size=16)), h),
            "magnitude": layer_error(w, w.masked_fill(_scheme_mask(w.abs(), scheme), 0), h),
            "wanda": layer_error(w, w.masked_fill(_scheme_mask(w.abs() * x.norm(dim=0), scheme), 0), h),
        }
        # the OBS update compensates through the correlations (measured: 5x below Wanda, 10x below magnitude)
        assert errors["sparsegpt"] < 0.5 * errors["wanda"] < 0.5 * errors["magnitude"], (pattern, errors)


def _scheme_mask(scores, scheme):
    from leanlm.compress.prune.sparsity import scheme_mask

    return scheme_mask(scores, scheme, per_row=True)


def test_sparsegpt_keeps_an_earlier_mask_and_its_block_fraction():
    w = _weights()
    h, _ = _correlated_hessian()
    earlier = torch.zeros_like(w, dtype=torch.bool)
    earlier[:, 5] = True  # a column an earlier step removed (its weights are zero by then)
    w[:, 5] = 0
    pruned = sparsegpt_prune(w, h, SparseGPTConfig(sparsity=0.5, block_size=16), earlier)
    assert (pruned[:, 5] == 0).all()
    for b in range(0, 64, 16):
        assert (pruned[:, b : b + 16] == 0).sum() == 16 * 32 // 2


def test_sparsegpt_config_validation():
    with pytest.raises(ValueError, match="multiple of the pattern"):
        SparseGPTConfig(pattern="4:8", block_size=12)
    with pytest.raises(ValueError, match="group_size"):
        SparseGPTConfig(bits=4, group_size=48)
    with pytest.raises(ValueError, match="scope"):
        MagnitudeConfig(scope="network")
    with pytest.raises(ValueError, match="local to each group"):
        MagnitudeConfig(pattern="2:4", scope="global")


# ---------------------------------------------------------------------------------------------- compress()


def _linears(model):
    return {n: m for n, m in model.named_modules() if n.startswith("model.layers.") and hasattr(m, "in_features")}


def test_magnitude_scopes(tiny_model):
    model = tiny_model()
    weights = {n: m.weight.detach().clone() for n, m in _linears(model).items()}
    threshold = global_threshold(list(weights.values()), 0.5)
    report = compress(model, MagnitudeConfig(scope="global", pack=False), progress=False)  # layers past 60% stay float
    zeros = sum(int((m.weight == 0).sum()) for m in _linears(model).values())
    total = sum(w.numel() for w in weights.values())
    assert zeros == int(0.5 * total)
    assert len({round(r.sparsity, 3) for r in report.linears}) > 1  # layers keep different fractions
    for name, m in _linears(model).items():
        assert torch.equal(m.weight == 0, weights[name].abs() <= threshold)
    model = tiny_model()
    report = compress(model, MagnitudeConfig(sparsity=0.25, scope="row"), progress=False)
    for m in _linears(model).values():
        assert ((m.weight == 0).sum(1) == int(0.25 * m.in_features)).all()
    assert model.lm_head.weight.ne(0).all()  # the head is ignored by default


@pytest.mark.parametrize("boost", [1.0, 50.0])
def test_wanda_ranks_by_weight_times_input_norm(tiny_model, calib, boost):
    # column 7 of gate_proj holds each row's 30th-percentile |w|: pruned on its own, kept once its input
    # channel is 50x larger
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight[7] *= boost
        gate = model.model.layers[0].mlp.gate_proj.weight
        gate[:, 7] = gate[:, 7].sign() * gate.abs().quantile(0.3, dim=1)
    compress(model, WandaConfig(sparsity=0.5), calib, progress=False)
    gate = model.model.layers[0].mlp.gate_proj.weight
    kept = gate[:, 7].ne(0).float().mean()
    assert kept == 1.0 if boost > 1 else kept < 0.2
    assert ((gate == 0).sum(1) == gate.shape[1] // 2).all()


@pytest.mark.parametrize("method", [MagnitudeConfig, WandaConfig, SparseGPTConfig])
def test_every_method_prunes_24_and_packs_it(tiny_model, calib, method):
    model = tiny_model()
    ref = dense_logits(model, calib)
    report = compress(model, method(pattern="2:4"), calib, progress=False)
    assert report.linears and all(r.format == "sparse24" and r.sparsity == pytest.approx(0.5) for r in report.linears)
    assert all(r.bytes_after < 0.6 * r.bytes_before for r in report.linears)
    for m in _linears(model).values():
        assert isinstance(m, Sparse24Linear) and satisfies_nm(m.dequantized_weight(), 2, 4)
    out = dense_logits(model, calib)
    assert torch.isfinite(out).all() and not torch.equal(out, ref)


def test_unpacked_24_stays_float_with_its_mask_and_packing_is_exact(tiny_model, calib):
    from leanlm.compress.prune.pruner import pack_semi_structured

    model = tiny_model()
    report = compress(model, WandaConfig(pattern="2:4", pack=False), calib, progress=False)
    assert {r.format for r in report.linears} == {"float"}
    for m in _linears(model).values():
        assert type(m).__name__ == "Linear" and torch.equal(pruned_mask(m), m.weight == 0)
    before = dense_logits(model, calib)
    reports = pack_semi_structured(model, report.linears)
    assert {r.format for r in reports} == {"sparse24"}
    assert torch.equal(dense_logits(model, calib), before)


def test_unstructured_prunes_pack_as_bitmask_from_the_threshold_on_exactly(tiny_model, calib):
    model = tiny_model()
    report = compress(model, WandaConfig(sparsity=0.7, pack=False), calib, progress=False)
    assert {r.format for r in report.linears} == {"float"}
    before = dense_logits(model, calib)
    reports = pack_semi_structured(model, report.linears)
    assert {r.format for r in reports} == {"sparse_bitmask"}
    assert all(r.bytes_after < 0.45 * r.bytes_before for r in reports if r.name != "lm_head")
    assert all(isinstance(m, BitmaskSparseLinear) for m in _linears(model).values())
    assert torch.equal(dense_logits(model, calib), before)  # the packed layers compute the same numbers
    packed = tiny_model()
    assert {r.format for r in compress(packed, WandaConfig(sparsity=0.7), calib, progress=False).linears} == {
        "sparse_bitmask"
    }
    below = tiny_model()  # 50% zeros: below MIN_SPARSITY, the dense kernel is as fast; stays float
    assert {r.format for r in compress(below, WandaConfig(sparsity=0.5), calib, progress=False).linears} == {"float"}


def test_sparsegpt_error_below_magnitude_on_the_tiny_model(tiny_model, calib):
    errors = {}
    for cfg in (MagnitudeConfig(pattern="2:4"), SparseGPTConfig(pattern="2:4")):
        model = tiny_model()
        ref = dense_logits(model, calib)
        compress(model, cfg, calib, progress=False)
        errors[cfg.name] = (dense_logits(model, calib) - ref).pow(2).mean().item()
    assert errors["sparsegpt"] < errors["magnitude"]


@pytest.mark.parametrize(
    "quantizer",
    [GPTQConfig(bits=4, group_size=32), GPTQConfig(bits=4, group_size=None), RTNConfig(bits=4, group_size=32)],
)
def test_zeros_survive_a_quantizer_later_in_the_recipe(tiny_model, calib, quantizer):
    model = tiny_model()
    compress(model, SparseGPTConfig(pattern="2:4", pack=False), calib, progress=False)
    masks = {n: pruned_mask(m).clone() for n, m in _linears(model).items()}
    compress(model, quantizer, calib, progress=False)
    for name, m in _linears(model).items():
        assert isinstance(m, RuntimeLinear)
        w = m.dequantized_weight()
        assert (w[masks[name]] == 0).all()
        assert satisfies_nm(w, 2, 4)


@pytest.mark.parametrize(
    ("quantizer", "format"),
    [
        (RTNConfig(bits=4, group_size=64), "sparse24_int4"),
        (RTNConfig(bits=8, group_size=None), "sparse24_int8"),
        (GPTQConfig(bits=4, group_size=64), "sparse24_int4"),  # act-order: static groups, so it packs
        (GPTQConfig(bits=8, group_size=64), "sparse24_int8"),
    ],
)
def test_prune_24_then_quantize_packs_the_kept_codes_exactly(tiny_model, calib, quantizer, format):
    model, unpacked = tiny_model(), tiny_model()
    recipe = [SparseGPTConfig(pattern="2:4"), quantizer]
    report = compress(model, recipe, calib, progress=False)
    assert {r.format for r in report.linears} == {format}
    assert all(r.bytes_after < 0.8 * r.bytes_before / (2 if quantizer.bits == 4 else 4) + 1 for r in report.linears)
    # the same recipe left dense (the pruner does not pack): the same numbers
    compress(unpacked, [SparseGPTConfig(pattern="2:4", pack=False), quantizer], calib, progress=False)
    for name, m in _linears(model).items():
        dense = _linears(unpacked)[name]
        assert m.format == format and dense.format in ("int8_weight_only", "int_group_weight_only")
        assert torch.equal(m.dequantized_weight(), dense.dequantized_weight())
    assert torch.equal(dense_logits(model, calib), dense_logits(unpacked, calib))


def test_gptq_static_groups_keep_input_order_and_act_orders_benefit():
    """Static groups (parameters fixed before the sweep, in input order) with act-order: no permutation is
    stored, each group's codes dequantize with its own input-order parameters, and the GPTQ objective stays
    below RTN's (the groups are coarser than act-order's own, so it may trail plain act-order a little)."""
    h, _ = _correlated_hessian(k=128)
    w = _weights(32, 128)
    cfg = GPTQConfig(bits=4, group_size=32, static_groups=True)
    result = gptq_quantize(w, h, cfg)
    assert result.perm is None
    scale, zero = result.qparams.scale[..., 0], result.qparams.zero[..., 0]  # [N, G]
    rebuilt = (result.codes.float() - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    assert torch.allclose(rebuilt, result.dequantized, atol=1e-6)
    rtn = gptq_quantize(w, torch.eye(128), GPTQConfig(bits=4, group_size=32, act_order=False))
    assert layer_error(w, result.dequantized, h) < layer_error(w, rtn.dequantized, h)
    dynamic = gptq_quantize(w, h, GPTQConfig(bits=4, group_size=32))
    assert layer_error(w, result.dequantized, h) < 1.5 * layer_error(w, dynamic.dequantized, h)


def test_joint_sparsegpt_quantizes_in_the_same_sweep(tiny_model, calib):
    model = tiny_model()
    ref = dense_logits(model, calib)
    report = compress(model, SparseGPTConfig(pattern="2:4", bits=4, group_size=32), calib, progress=False)
    assert {r.format for r in report.linears} == {"int_group_weight_only"}
    for m in _linears(model).values():
        assert isinstance(m, RuntimeLinear) and satisfies_nm(m.dequantized_weight(), 2, 4)
    assert torch.isfinite(dense_logits(model, calib)).all()
    assert not torch.equal(dense_logits(model, calib), ref)


def test_pattern_that_does_not_divide_a_layer_says_what_to_do(tiny_model):
    with pytest.raises(ValueError, match="divisible by 7"):
        compress(tiny_model(), MagnitudeConfig(pattern="3:7"), progress=False)


def test_data_methods_need_calibration(tiny_model):
    with pytest.raises(ValueError, match="need calibration samples"):
        compress(tiny_model(), WandaConfig(), None, progress=False)


def test_pruning_leaves_the_checkpoint_tensors_alone(tiny_model):
    # a model built in float32 from a float32 state dict shares its tensors; pruning must not write into them
    from leanlm.model.llama import build_model
    from tests.conftest import tiny_config, tiny_state_dict

    cfg = tiny_config(256, "llama")
    state = tiny_state_dict(cfg, 0)
    before = {k: v.clone() for k, v in state.items()}
    compress(build_model(cfg, state, torch.float32), MagnitudeConfig(), progress=False)
    assert all(torch.equal(state[k], before[k]) for k in state)


def test_pruners_pack_in_their_finalize_hook_after_every_method_ran(tiny_model, calib):
    """The layer loop leaves pruned linears float; each method's finalize runs after it, in recipe order, and only
    a pruner's packs (2:4 values + mask; after a quantizer, the quantized 2:4 format)."""
    from leanlm.compress.base import build_method

    model = tiny_model()
    report = compress(
        model, [MagnitudeConfig(pattern="2:4"), RTNConfig(bits=8, group_size=None)], calib, progress=False
    )
    down = model.model.layers[0].mlp.down_proj
    assert not isinstance(down, (torch.nn.Linear, Sparse24Linear)) and "24" in down.format
    assert {r.format for r in report.linears if r.name.endswith("down_proj")} == {down.format}
    rtn = build_method(RTNConfig(bits=8))
    assert rtn.finalize(model, report.linears) is report.linears  # the default: nothing changes
    kept = tiny_model()
    compress(kept, MagnitudeConfig(pattern="2:4", pack=False), progress=False)
    kept_down = kept.model.layers[0].mlp.down_proj
    assert isinstance(kept_down, torch.nn.Linear) and not isinstance(kept_down, Sparse24Linear)  # pack=False
