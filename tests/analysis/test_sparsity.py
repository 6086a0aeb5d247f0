"""Weight sparsity reports: zeros counted through every runtime format, per layer and per kind."""

import torch

from leanlm.analysis.sparsity import by_kind, by_layer, format_sparsity, linear_sparsity, overall
from leanlm.compress import MagnitudeConfig, RTNConfig, WandaConfig, compress
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


def _model():
    cfg = tiny_config(256, "llama")
    return build_model(cfg, tiny_state_dict(cfg, 0), torch.float32)


def test_dense_model_has_no_zeros_and_pruned_layers_are_counted():
    model = _model()
    rows = linear_sparsity(model)
    assert len(rows) == 7 * len(model.model.layers) and overall(rows) == 0
    compress(model, MagnitudeConfig(sparsity=0.5, ignore=("lm_head", "down_proj")), progress=False)
    rows = linear_sparsity(model)
    kinds = by_kind(rows)
    assert kinds["down_proj"] == 0 and kinds["q_proj"] == 0.5
    assert 0.3 < overall(rows) < 0.5
    assert set(by_layer(rows)) == set(range(len(model.model.layers)))
    text = format_sparsity(rows)
    assert "down_proj 0.0%" in text and "q_proj 50.0%" in text


def test_zeros_are_counted_in_packed_and_quantized_layers():
    calib = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    packed = _model()
    compress(packed, WandaConfig(pattern="2:4"), calib, progress=False)
    assert overall(linear_sparsity(packed)) == 0.5
    quantized = _model()
    compress(quantized, [MagnitudeConfig(pattern="2:4"), RTNConfig(bits=4, group_size=32)], progress=False)
    assert overall(linear_sparsity(quantized)) >= 0.5


def test_the_inputs_activation_sparse_layers_zero_are_counted_while_the_meter_is_on():
    from leanlm.analysis.sparsity import InputSparsityMeter
    from leanlm.compress import ActivationSparsityConfig
    from leanlm.model.forward import logits

    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    model = _model()
    assert InputSparsityMeter(model).format() is None  # no activation-sparse layer
    compress(model, ActivationSparsityConfig(sparsity=0.5, ignore=("lm_head", "down_proj")), calib, progress=False)
    with InputSparsityMeter(model) as meter:
        logits(model, calib)  # the calibration text: each layer zeroes about half of what it saw there
    rows = meter.rows()
    assert len(rows) == 6 * len(model.model.layers)  # every sparsified linear, not down_proj
    assert all(r.numel == 4 * 16 * model.config.hidden_size for r in rows if r.name.endswith("q_proj"))
    assert 0.45 < overall(rows) < 0.55
    assert "q_proj" in meter.format() and "down_proj" not in meter.format()
    logits(model, calib)  # the meter is off: nothing more is counted
    assert meter.rows() == rows
