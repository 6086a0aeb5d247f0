"""Affine primitives: grids, granularities, packing, FP8."""

import pytest
import torch

from leanlm.model.quantized.numerics import (
    Granularity,
    QuantSpec,
    compute_qparams,
    dequantize,
    fake_quantize,
    grouped,
    pack_int4,
    quantize,
    quantize_fp8,
    shrink_qparams,
    sqnr_db,
    unpack_int4,
)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran,group", [("tensor", None), ("channel", None), ("token", None), ("group", 32)])
def test_codes_stay_on_the_grid_and_error_is_half_a_step(bits, symmetric, gran, group):
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(bits))
    spec = QuantSpec(bits, symmetric, gran, group)
    qp = compute_qparams(x, spec)
    q = quantize(x, qp, spec)
    assert q.min() >= spec.qmin and q.max() <= spec.qmax
    err = (dequantize(q, qp, spec) - x).abs()
    # every value lies inside its unit's range, so the error is at most half a step of that unit
    from leanlm.model.quantized.numerics import grouped

    step = qp.scale.expand_as(grouped(x, spec)).reshape(x.shape) if gran != "tensor" else qp.scale
    assert torch.all(err <= step / 2 + 1e-6)


def test_more_bits_and_smaller_groups_are_more_accurate():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    s = {b: sqnr_db(w, fake_quantize(w, QuantSpec(b, False, "group", 64))) for b in (2, 3, 4, 8)}
    assert s[2] < s[3] < s[4] < s[8]
    assert s[8] > 40 and s[4] > 18
    per_channel = sqnr_db(w, fake_quantize(w, QuantSpec(4, False, "channel")))
    assert sqnr_db(w, fake_quantize(w, QuantSpec(4, False, "group", 32))) > per_channel


def test_asymmetric_grid_holds_zero_and_zero_rows_do_not_nan():
    x = torch.zeros(3, 64)
    x[1] = torch.rand(64) + 1  # all positive: zero point at the bottom
    for sym in (True, False):
        spec = QuantSpec(4, sym, "channel")
        y = fake_quantize(x, spec)
        assert torch.isfinite(y).all()
        assert torch.equal(y[0], torch.zeros(64))


def test_spec_validation():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=9)
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec(4, granularity="group")
    with pytest.raises(ValueError):
        QuantSpec(4, granularity="rows")
    with pytest.raises(ValueError, match="multiple of group_size"):
        compute_qparams(torch.randn(4, 100), QuantSpec(4, granularity=Granularity.GROUP, group_size=64))


def test_int4_packing_round_trips_exactly():
    q = torch.randint(0, 16, (7, 96), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (7, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)  # low nibble first
    with pytest.raises(ValueError):
        pack_int4(torch.full((2, 4), 16))
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("fmt,dtype,min_db", [("e4m3", torch.float8_e4m3fn, 28), ("e5m2", torch.float8_e5m2, 20)])
def test_fp8_scaled_quantization(fmt, dtype, min_db):
    x = torch.randn(32, 256) * torch.logspace(-2, 2, 32)[:, None]  # rows of very different ranges
    q, scale = quantize_fp8(x, dtype, per_row=True)
    assert q.dtype == dtype and scale.shape == (32, 1)
    assert torch.isfinite(q.float()).all()
    assert sqnr_db(x, q.float() * scale) > min_db
    big = torch.tensor([[1e6, -1e6, 1.0]])
    qb, sb = quantize_fp8(big, dtype)
    assert torch.isfinite(qb.float()).all() and (qb.float() * sb)[0, 0] == pytest.approx(1e6, rel=0.01)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran,group", [("channel", None), ("group", 32)])
def test_shrunk_ranges_never_lose_to_min_max_and_clip_outliers(symmetric, gran, group):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 128, generator=gen)
    x[torch.arange(32), torch.randint(0, 128, (32,), generator=gen)] *= 8  # one outlier per row
    spec = QuantSpec(3, symmetric, gran, group)

    def unit_err(qp):  # |x - q|^2.4 per quantization unit
        return grouped((dequantize(quantize(x, qp, spec), qp, spec) - x).abs().pow(2.4), spec).sum(-1)

    plain, shrunk = compute_qparams(x, spec), shrink_qparams(x, spec)
    assert torch.all(unit_err(shrunk) <= unit_err(plain) * (1 + 1e-6))
    assert unit_err(shrunk).sum() < 0.95 * unit_err(plain).sum()  # the outliers get clipped: a real gain (0.80-0.92)
    assert torch.all(shrunk.scale <= plain.scale * (1 + 1e-6))
