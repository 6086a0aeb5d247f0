"""Runtime quantized layers: reference numerics, metadata round trips, the W8A8 / FP8 / LLM.int8() paths."""

import pytest
import torch

from leanlm.compress.quantize.int_scheme import IntScheme
from leanlm.compress.quantize.llm_int8 import llm_int8_linear
from leanlm.compress.quantize.rtn import quantize_rtn
from leanlm.model.linear.base import LINEAR_FORMATS
from leanlm.model.linear.fp8 import FP8Linear
from leanlm.model.linear.w8a8 import Int8DynamicActLinear
from leanlm.model.quantized.numerics import quantize_fp8, sqnr_db

GEN = torch.Generator().manual_seed(0)


def _linear(n=96, k=128):
    return torch.randn(n, k, generator=GEN) / k**0.5, torch.randn(n, generator=GEN) * 0.1


@pytest.mark.parametrize(
    "scheme,min_db",
    [
        (IntScheme(bits=8, group_size=None), 38),
        (IntScheme(bits=8, group_size=32), 40),
        (IntScheme(bits=6, group_size=None), 26),
        (IntScheme(bits=5, group_size=32), 22),
        (IntScheme(bits=4, group_size=64), 17),
        (IntScheme(bits=4, group_size=32, symmetric=True), 15),
        (IntScheme(bits=3, group_size=64), 11),
        (IntScheme(bits=2, group_size=32), 5),
        (IntScheme(bits=8, group_size=None, act_bits=8), 33),
        (IntScheme(bits=8, group_size=64, act_bits=8), 33),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_layers_track_float_outputs(scheme, min_db, dtype):
    w, b = _linear()
    x = torch.randn(5, 128, generator=GEN)
    layer = quantize_rtn(w, b, scheme).set_compute_dtype(dtype)
    ref = x @ w.t() + b
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (5, 96)
    assert sqnr_db(ref, y.float()) > min_db
    # forward agrees with the dequantized weight it reports (activation quantization aside)
    if scheme.act_bits is None:
        assert sqnr_db(x @ layer.dequantized_weight().t() + b, y.float()) > (40 if dtype == torch.float32 else 30)


@pytest.mark.parametrize(
    "scheme",
    [
        IntScheme(bits=8, group_size=None),
        IntScheme(bits=8, group_size=32),
        IntScheme(bits=4, group_size=64),
        IntScheme(bits=3, group_size=32),
        IntScheme(bits=8, group_size=None, act_bits=8),
    ],
)
def test_metadata_and_tensors_rebuild_the_same_layer(scheme):
    w, b = _linear()
    layer = quantize_rtn(w, b, scheme)
    meta = layer.metadata()
    tensors = {k: v for k, v in layer.state_dict().items()}
    clone = LINEAR_FORMATS[meta["format"]].from_tensors(meta, tensors)
    x = torch.randn(3, 128, generator=GEN)
    assert torch.equal(clone(x), layer(x))
    assert torch.equal(clone.dequantized_weight(), layer.dequantized_weight())


def test_weight_bytes_shrink_with_bits():
    w, b = _linear(256, 256)
    sizes = {
        bits: quantize_rtn(w, b, IntScheme(bits=bits, group_size=None if bits == 8 else 64)).weight_bytes()
        for bits in (8, 4)
    }
    assert sizes[8] == 256 * 256 + 256 * 4
    assert sizes[4] == 256 * 128 + 2 * 256 * 4 * 4  # codes + scales + mins (float32, 4 groups)


def test_w8a8_int_mm_matches_its_float_simulation():
    w, b = _linear()
    layer = quantize_rtn(w, b, IntScheme(bits=8, group_size=None, act_bits=8))
    assert isinstance(layer, Int8DynamicActLinear)
    x = torch.randn(20, 128, generator=GEN)
    from leanlm.model.quantized.numerics import quantize_per_token_int8

    xq, xs = quantize_per_token_int8(x)
    sim = (xq.double() * xs.double()) @ layer.dequantized_weight().double().t() + b.double()
    assert torch.allclose(layer(x).double(), sim, atol=1e-5)


def test_llm_int8_keeps_outlier_columns_exact():
    w, b = _linear()
    outliers = torch.tensor([3, 70])
    layer = llm_int8_linear(w, b, outliers, threshold=6.0)
    assert torch.equal(layer.outlier_weight, w[:, outliers])  # bit-exact 16/32-bit columns
    assert torch.equal(layer.dequantized_weight()[:, outliers], w[:, outliers])
    x = torch.zeros(4, 128)
    x[:, outliers] = torch.randn(4, 2, generator=GEN) * 40  # only outlier features active
    assert torch.allclose(layer(x), x @ w.t() + b, atol=1e-5)
    # a run-time outlier column not seen in calibration takes the 16-bit path with its int8 weights
    x2 = torch.randn(4, 128, generator=GEN)
    x2[0, 5] = 50.0
    y = layer(x2)
    assert sqnr_db(x2 @ w.t() + b, y) > 35
    assert sqnr_db(x2 @ layer.dequantized_weight().t() + b, y) > 40  # activations lose almost nothing


def test_fp8_layer():
    w, b = _linear()
    wq, ws = quantize_fp8(w, torch.float8_e4m3fn)
    layer = FP8Linear(wq, ws, b)
    x = torch.randn(6, 128, generator=GEN)
    assert sqnr_db(x @ w.t() + b, layer(x)) > 25
    assert layer.weight_bytes() == 96 * 128 + 96 * 4
