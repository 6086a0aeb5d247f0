"""TEAL's block-level greedy allocation: the steps are chosen on the layer's own output, so a linear whose
inputs the layer's output does not depend on takes sparsity first; the layer ends at its bytes-weighted target."""

import pytest
import torch

from leanlm.compress.activation.act_allocation import Candidate, block_levels
from leanlm.compress.activation.act_sparsity import threshold_for
from leanlm.compress.base import NEEDS_STATS
from leanlm.compress.calibration import LayerRunner, observe_inputs
from leanlm.compress.quantize.linear_quantizer import group_linears

LEVELS = [i * 0.05 for i in range(19)]


def _candidates(model, layer, hidden):
    """Each linear of `layer` with its thresholds, from what the compression loop observes on hidden [S, T, d]."""
    fed = observe_inputs(layer, LayerRunner(model, hidden.shape[1], hidden.shape[0]), hidden, frozenset({NEEDS_STATS}))
    out = {}
    for _, full, m, group in group_linears(layer, "layer", fed):
        scale = torch.ones(m.in_features)
        out[full] = Candidate(m, scale, [threshold_for(group.samples.abs(), level) for level in LEVELS])
    return out


def _layer_and_inputs(tiny_model, calib):
    model = tiny_model()
    hidden = model.model.embed_tokens(calib).detach()  # [S, T, d]: what enters layer 0
    rope = model.rotary_emb(torch.arange(calib.shape[1]), hidden.dtype)
    return model, model.model.layers[0], hidden, rope


def test_a_linear_the_output_ignores_takes_its_sparsity_first(tiny_model, calib):
    model, layer, hidden, rope = _layer_and_inputs(tiny_model, calib)
    with torch.no_grad():
        layer.mlp.down_proj.weight.zero_()  # the MLP adds nothing: its inputs' sparsity costs nothing
    candidates = _candidates(model, layer, hidden)
    chosen = block_levels(layer, hidden, rope, candidates, LEVELS, target=0.3)
    # every MLP input is free (gate/up feed only down_proj, whose output is zero), and the MLP holds enough bytes
    # for the target: the attention, whose inputs do matter, keeps all of them
    assert chosen["layer.mlp.gate_proj"] == LEVELS[-1]
    assert all(chosen[f"layer.self_attn.{n}_proj"] == 0 for n in "qkvo")


def test_the_layer_ends_at_its_bytes_weighted_target_and_its_hooks_are_gone(tiny_model, calib):
    model, layer, hidden, rope = _layer_and_inputs(tiny_model, calib)
    candidates = _candidates(model, layer, hidden)
    chosen = block_levels(layer, hidden, rope, candidates, LEVELS, target=0.4)
    sizes = {n: c.linear.weight.numel() for n, c in candidates.items()}
    reached = sum(chosen[n] * sizes[n] for n in sizes) / sum(sizes.values())
    assert 0.4 - 1e-9 <= reached < 0.4 + 0.05  # at most one step past the target
    assert len(set(chosen.values())) > 1  # uneven: the point of allocating
    assert all(not c.linear._forward_pre_hooks for c in candidates.values())


@pytest.mark.real_model
def test_on_smollm2_the_block_allocation_costs_the_layer_less_than_uniform_thresholds(smollm):
    from leanlm.compress import read_calibration_text
    from leanlm.model.forward import decoder_layer
    from leanlm.model.llama import build_model

    model = build_model(smollm.config, smollm.state_dict, torch.float32)
    ids = smollm.tokenizer.encode(read_calibration_text()[:20_000], add_special_tokens=False)
    calib = torch.tensor(ids[: 4 * 128]).view(4, 128)
    with torch.no_grad():  # what enters layer 2 of the real model
        rope = model.rotary_emb(torch.arange(128), torch.float32)
        hidden = model.model.embed_tokens(calib)
        for layer in model.model.layers[:2]:
            hidden = decoder_layer(layer, hidden, rope)
    layer = model.model.layers[2]
    candidates = _candidates(model, layer, hidden)
    chosen = block_levels(layer, hidden[:2], rope, candidates, LEVELS, target=0.4)

    def layer_error(sparsity: dict) -> float:  # on the other two sequences, which the allocation never ran
        handles = [
            c.linear.register_forward_pre_hook(
                lambda _, a, c=c, t=c.thresholds[LEVELS.index(sparsity[n])]: (a[0].masked_fill(a[0].abs() <= t, 0),)
            )
            for n, c in candidates.items()
        ]
        try:
            with torch.no_grad():
                y = decoder_layer(layer, hidden[2:], rope)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            ref = decoder_layer(layer, hidden[2:], rope)
        return float((y - ref).pow(2).sum() / (ref - hidden[2:]).pow(2).sum())

    uniform = layer_error(dict.fromkeys(candidates, LEVELS[8]))  # 40% of every linear's inputs
    assert layer_error(chosen) < 0.5 * uniform  # measured: 0.012 against 0.102
