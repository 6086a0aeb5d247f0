"""TEAL's block-level greedy allocation: the steps are chosen on the layer's own output, so a linear whose
inputs the layer's output does not depend on takes sparsity first; the layer ends at its bytes-weighted target."""

import torch

from leanlm.compress.act_allocation import Candidate, block_levels, layer_inputs
from leanlm.compress.act_sparsity import threshold_for
from leanlm.compress.linear_quantizer import group_linears

LEVELS = [i * 0.05 for i in range(19)]


def _candidates(layer, hidden, rope):
    fed = layer_inputs(layer, hidden, rope)
    out = {}
    for _, full, m, group in group_linears(layer, "layer", fed):
        scale = torch.ones(m.in_features)
        out[full] = Candidate(m, scale, [threshold_for(group.samples.abs(), level) for level in LEVELS])
    return out


def _layer_and_inputs(tiny_model, calib):
    model = tiny_model()
    hidden = model.model.embed_tokens(calib).detach()  # [S, T, d]: what enters layer 0
    rope = model.rotary_emb(torch.arange(calib.shape[1]), hidden.dtype)
    return model.model.layers[0], hidden, rope


def test_a_linear_the_output_ignores_takes_its_sparsity_first(tiny_model, calib):
    layer, hidden, rope = _layer_and_inputs(tiny_model, calib)
    with torch.no_grad():
        layer.mlp.down_proj.weight.zero_()  # the MLP adds nothing: its inputs' sparsity costs nothing
    candidates = _candidates(layer, hidden, rope)
    chosen = block_levels(layer, hidden, rope, candidates, LEVELS, target=0.3)
    # every MLP input is free (gate/up feed only down_proj, whose output is zero), and the MLP holds enough bytes
    # for the target: the attention, whose inputs do matter, keeps all of them
    assert chosen["layer.mlp.gate_proj"] == LEVELS[-1]
    assert all(chosen[f"layer.self_attn.{n}_proj"] == 0 for n in "qkvo")


def test_the_layer_ends_at_its_bytes_weighted_target_and_its_hooks_are_gone(tiny_model, calib):
    layer, hidden, rope = _layer_and_inputs(tiny_model, calib)
    candidates = _candidates(layer, hidden, rope)
    chosen = block_levels(layer, hidden, rope, candidates, LEVELS, target=0.4)
    sizes = {n: c.linear.weight.numel() for n, c in candidates.items()}
    reached = sum(chosen[n] * sizes[n] for n in sizes) / sum(sizes.values())
    assert 0.4 - 1e-9 <= reached < 0.4 + 0.05  # at most one step past the target
    assert len(set(chosen.values())) > 1  # uneven: the point of allocating
    assert all(not c.linear._forward_pre_hooks for c in candidates.values())
