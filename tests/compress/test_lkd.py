"""ZeroQuant's LKD after a quantizer: the fake-quantized stand-in starts exactly at the quantized layer, training
lowers each layer's distance to the float layer, the layers keep their runtime formats, and what LKD cannot
train is refused with what to do."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress import GPTQConfig, LKDConfig, RTNConfig, compress
from leanlm.compress.quantize.int_scheme import IntScheme
from leanlm.compress.quantize.rtn import quantize_rtn
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.quantized.fake_quant import FakeQuantLinear
from tests.compress.conftest import dense_logits

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "scheme",
    [IntScheme(bits=4, group_size=32), IntScheme(bits=3, group_size=32), IntScheme(bits=8, group_size=None)],
)
def test_the_stand_in_starts_at_the_quantized_layer_and_converts_back_exactly(scheme):
    w, b = torch.randn(48, 64, generator=GEN) / 8, torch.randn(48, generator=GEN)
    layer = quantize_rtn(w, b, scheme)
    stand_in = FakeQuantLinear(layer)
    x = torch.randn(5, 64, generator=GEN)
    with torch.no_grad():
        assert torch.allclose(stand_in(x), layer(x), atol=1e-5)
    back = stand_in.to_module()
    assert type(back) is type(layer)
    assert torch.allclose(back.dequantized_weight(), layer.dequantized_weight(), atol=1e-6)


def test_lkd_brings_each_layer_closer_to_the_float_one(tiny_model, calib):
    teacher, model = tiny_model(), tiny_model()
    report = compress(model, [RTNConfig(bits=3, group_size=32), LKDConfig(steps=30, lr=1e-2)], calib, progress=False)
    lkd = report.details["lkd"]
    assert lkd["layer rel. MSE after"] < 0.8 * lkd["layer rel. MSE before"] and lkd["layers improved"] == 1
    layers = [m for m in model.modules() if isinstance(m, IntGroupWeightOnlyLinear)]
    assert len(layers) == 14 and all(m.bits == 3 for m in layers)  # 7 linears x 2 layers, still 3-bit
    rtn = tiny_model()
    compress(rtn, [RTNConfig(bits=3, group_size=32)], calib, progress=False)
    with torch.no_grad():
        float_logits = dense_logits(teacher, calib)
        err_rtn = (dense_logits(rtn, calib) - float_logits).pow(2).mean()
        err_lkd = (dense_logits(model, calib) - float_logits).pow(2).mean()
    assert err_lkd < err_rtn  # on the calibration text itself: what LKD fits


def test_a_layer_that_training_made_worse_keeps_the_quantizers_result(tiny_model, calib):
    rtn, model = tiny_model(), tiny_model()
    compress(rtn, [RTNConfig(bits=4, group_size=32)], calib, progress=False)
    report = compress(model, [RTNConfig(bits=4, group_size=32), LKDConfig(steps=3, lr=10.0)], calib, progress=False)
    assert report.details["lkd"]["layers improved"] == 0  # a step of 10 wrecks every weight
    for a, b in zip(rtn.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_lkd_keeps_int8_layers_int8(tiny_model, calib):
    model = tiny_model()
    compress(model, [RTNConfig(bits=8, group_size=None), LKDConfig(steps=2)], calib, progress=False)
    assert sum(isinstance(m, Int8WeightOnlyLinear) for m in model.modules()) == 14


def test_what_lkd_cannot_train_says_what_to_do(tiny_model, calib):
    with pytest.raises(ValueError, match="need calibration samples"):
        compress(tiny_model(), [RTNConfig(bits=4, group_size=32), LKDConfig()], progress=False)
    model = tiny_model()
    with pytest.raises(ValueError, match="without act-order"):
        compress(model, [GPTQConfig(bits=4, group_size=32), LKDConfig(steps=1)], calib, progress=False)
    with pytest.raises(ValueError, match="steps >= 1"):
        LKDConfig(steps=0)
