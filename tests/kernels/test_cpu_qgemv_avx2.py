"""The AVX2 level's float32 int4 / int8 GEMVs and dequantizations: float64 references on the dequantized weight
within fp32 accumulation slack (every supported group size, M = 1..8 and several passes, 3-D inputs, biases, tails
of N that are not whole tiles), exact dequantization, thread-count invariance, argument checks, and the layers
routing float32 rows to them."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_qgemv_avx2 as avx2
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.quantized.numerics import unpack_int4

pytestmark = pytest.mark.skipif(not avx2.is_available(), reason=f"AVX2 kernels: {avx2.unavailable_reason()}")
EPS32 = 2.0**-23


def _int4(N: int, K: int, G: int, g: torch.Generator):
    qweight = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, K // G, generator=g) * 0.02 + 1e-3
    mins = -8 * scales + torch.randn(N, K // G, generator=g) * 1e-3
    w = (unpack_int4(qweight).float().view(N, K // G, G) * scales[..., None] + mins[..., None]).reshape(N, K)
    return qweight, scales, mins, w


def _int8(N: int, K: int, G: int | None, g: torch.Generator):
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    if G is None:
        scales = torch.rand(N, generator=g) * 0.02 + 1e-3
        return qweight, scales, qweight.float() * scales[:, None]
    scales = torch.rand(N, K // G, generator=g) * 0.02 + 1e-3
    return qweight, scales, (qweight.float().view(N, K // G, G) * scales[..., None]).reshape(N, K)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """fp32 sums of K terms: each output within a few fp32 ulps of |x| @ |w|^T per term of the chain."""
    ref = x.double() @ w.double().T + (0.0 if bias is None else bias.double())
    assert y.dtype == torch.float32 and y.shape == ref.shape
    slack = (x.shape[-1] // 4 + 16) * EPS32 * (x.double().abs() @ w.double().abs().T)
    if bias is not None:
        slack = slack + 2 * EPS32 * bias.double().abs()
    err = (y.double() - ref).abs()
    assert (err <= slack).all(), f"max err {err.max():.3g}, worst excess {(err - slack).max():.3g}"


@pytest.mark.parametrize(("N", "K", "G"), [(96, 64, 32), (77, 192, 64), (40, 256, 128), (33, 576, 32)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("has_bias", [False, True])
def test_int4_matches_float64(N, K, G, M, has_bias):
    g = torch.Generator().manual_seed(N * 1000 + M)
    qweight, scales, mins, w = _int4(N, K, G, g)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g) if has_bias else None
    _check(avx2.linear_int4(x, qweight, scales, mins, G, bias), x, w, bias)


@pytest.mark.parametrize("G", [None, 16, 32, 64])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 9])
def test_int8_matches_float64(G, M):
    N, K = 45, 128
    g = torch.Generator().manual_seed(M)
    qweight, scales, w = _int8(N, K, G, g)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g)
    _check(avx2.linear_int8(x, qweight, scales, bias, G), x, w, bias)


def test_leading_dims_and_outliers():
    g = torch.Generator().manual_seed(3)
    qweight, scales, mins, w = _int4(64, 128, 32, g)
    x = torch.randn(2, 3, 128, generator=g)
    x[0, 1, 7] = 3000.0  # a "massive activation"
    y = avx2.linear_int4(x, qweight, scales, mins, 32)
    assert y.shape == (2, 3, 64)
    _check(y.view(6, 64), x.view(6, 128), w, None)


def test_dequantization_is_exactly_the_reference():
    g = torch.Generator().manual_seed(1)
    qweight, scales, mins, w = _int4(50, 192, 64, g)
    assert torch.equal(avx2.dequantize_int4(qweight, scales, mins, 64), w)
    for G in (None, 16, 32):
        q8, s8, w8 = _int8(50, 192, G, g)
        assert torch.equal(avx2.dequantize_int8(q8, s8, G), w8)


def test_results_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(2)
    qweight, scales, mins, _ = _int4(1024, 512, 32, g)  # big enough to split over threads
    x = torch.randn(3, 512, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = avx2.linear_int4(x, qweight, scales, mins, 32)
        torch.set_num_threads(2)
        two = avx2.linear_int4(x, qweight, scales, mins, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_arguments_say_what_is_wrong():
    g = torch.Generator().manual_seed(4)
    qweight, scales, mins, _ = _int4(32, 64, 32, g)
    with pytest.raises(ValueError, match="x must be a contiguous float32"):
        avx2.linear_int4(torch.randn(1, 64).to(torch.bfloat16), qweight, scales, mins, 32)
    with pytest.raises(ValueError, match="group_size must be a multiple of 32"):
        avx2.linear_int4(torch.randn(1, 64), qweight, scales.repeat(1, 4), mins.repeat(1, 4), 8)
    with pytest.raises(ValueError, match="x has shape"):
        avx2.linear_int4(torch.randn(1, 32), qweight, scales, mins, 32)
    q8, s8, _ = _int8(32, 64, None, g)
    with pytest.raises(ValueError, match="group_size must be a multiple of 8"):
        avx2.linear_int8(torch.randn(1, 64), q8, torch.rand(32, 16), None, 4)
    rows = avx2.MAX_ROWS
    assert not avx2.should_use_int4(torch.randn(rows + 1, 64), qweight, 32)  # more rows: dequantize + sgemm
    assert avx2.should_use_int4(torch.randn(rows, 64), qweight, 32)
    assert avx2.should_use_int4_a8(torch.randn(avx2.MAX_ROWS_A8, 64), qweight, 32)
    assert not avx2.should_use_int8(torch.randn(1, 64).double(), q8, None)


def test_layers_route_float32_rows_to_the_kernels(monkeypatch):
    """Few float32 rows take the GEMV, many take the float32 dequantization, and both equal the reference path."""
    g = torch.Generator().manual_seed(5)
    qweight, scales, mins, _ = _int4(96, 128, 32, g)
    bias = torch.randn(96, generator=g)
    int4 = IntGroupWeightOnlyLinear(qweight, scales, mins, bias, bits=4, group_size=32)
    q8, s8, _ = _int8(96, 128, 32, g)
    int8 = Int8WeightOnlyLinear(q8, s8, bias, group_size=32)
    for layer in (int4, int8):
        for rows in (1, 8, 40):
            x = torch.randn(rows, 128, generator=g)
            assert layer.few_rows_fit(x) is (rows <= avx2.MAX_ROWS)
            torch.testing.assert_close(layer(x), layer.reference_forward(x), rtol=1e-5, atol=1e-4)
    calls = []
    monkeypatch.setattr(avx2, "dequantize_int4", lambda *a: calls.append(a) or unpack_int4(a[0]).float())
    int4(torch.randn(40, 128))
    assert len(calls) == 1  # many rows: the AVX2 dequantization, not the per-call torch reference


def _a8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from leanlm.kernels import cpu_a8

    return cpu_a8.reference(x.double(), w.double(), None if bias is None else bias.double())


def _check_a8(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Against the fake-quantized float reference: integer dot products are exact, so only fp32 scaling and sums
    differ (well below one activation code's worth)."""
    ref = _a8_reference(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    from leanlm.kernels.act_int8 import fake_quantize_act_int8

    slack = (x.shape[-1] // 4 + 16) * EPS32 * (fake_quantize_act_int8(x).double().abs() @ w.double().abs().T)
    err = (y.double() - ref).abs()
    assert (err <= slack + 1e-6).all(), f"max err {err.max():.3g}"


@pytest.mark.parametrize(("N", "K", "G"), [(96, 64, 32), (77, 192, 64), (40, 256, 128), (33, 576, 32)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8])
def test_int4_with_int8_activations_matches_the_reference(N, K, G, M):
    g = torch.Generator().manual_seed(N + M)
    qweight, scales, mins, w = _int4(N, K, G, g)
    x = torch.randn(M, K, generator=g)
    x[0, 0] = 40.0  # one group with a large scale
    x[-1, :32] = 0.0  # an all-zero group: scale floor, zero codes
    bias = torch.randn(N, generator=g)
    _check_a8(avx2.linear_int4_a8(x, qweight, scales, mins, G, bias), x, w, bias)


@pytest.mark.parametrize("G", [None, 32, 64])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_int8_with_int8_activations_matches_the_reference(G, M):
    g = torch.Generator().manual_seed(M)
    qweight, scales, w = _int8(45, 128, G, g)
    qweight[0, :32] = -128  # |w| = 128 still fits vpmaddubsw's unsigned operand
    w = (qweight.float() * scales[:, None]) if G is None else (qweight.float().view(45, -1, G) * scales[..., None])
    w = w.reshape(45, 128)
    x = torch.randn(M, 128, generator=g)
    _check_a8(avx2.linear_int8_a8(x, qweight, scales, None, G), x, w, None)


def test_int8_activation_kernels_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(7)
    qweight, scales, mins, _ = _int4(1024, 512, 32, g)
    q8, s8, _ = _int8(1024, 512, 32, g)
    x = torch.randn(5, 512, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((avx2.linear_int4_a8(x, qweight, scales, mins, 32), avx2.linear_int8_a8(x, q8, s8, None, 32)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_layers_with_int8_activations_take_the_kernels():
    from leanlm.model.linear.act_quant import activation_quant, resolve_activation_quant

    g = torch.Generator().manual_seed(8)
    qweight, scales, mins, w = _int4(96, 128, 32, g)
    layer = IntGroupWeightOnlyLinear(qweight, scales, mins, bits=4, group_size=32)
    wrapper = torch.nn.Sequential(layer)
    assert resolve_activation_quant(wrapper, "int8") == ("int8", 1)
    for rows in (1, 8, 20):  # 20 rows: the fake-quantized reference on the AVX2 dequantization
        x = torch.randn(rows, 128, generator=g)
        with activation_quant("int8"):
            y = layer(x)
        torch.testing.assert_close(y.double(), _a8_reference(x, w, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("K", "G"), [(576, 32), (1536, 64), (256, 128)])
@pytest.mark.parametrize("M", [1, 5])
def test_half_scales_give_the_same_result(K, G, M):
    """GGUF's Q4_1 keeps d and m in half: read as half (a sixth fewer bytes), the result is bit for bit the float32
    scales' one; scales half cannot hold exactly get no half copy."""
    g = torch.Generator().manual_seed(K + M)
    qweight, scales, mins, w = _int4(64, K, G, g)
    scales, mins = scales.half().float(), mins.half().float()  # values half holds exactly, as a GGUF file's
    halves = avx2.half_copies(scales, mins, G)
    assert halves is not None and halves[0].dtype is torch.float16
    x = torch.randn(M, K, generator=g)
    assert torch.equal(avx2.linear_int4_a8(x, qweight, *halves, G), avx2.linear_int4_a8(x, qweight, scales, mins, G))
    assert avx2.half_copies(scales + 1e-4, mins, G) is None  # not exact in half
    assert avx2.half_copies(scales[:, :1].repeat(1, K // 96), mins[:, :1].repeat(1, K // 96), 96) is None  # 96


def test_int8_activations_outside_the_64_code_steps_take_the_reference():
    """K = 96 (or groups of 96): the W4A8 kernel refuses with a clear error, and a layer runs the reference."""
    from leanlm.model.linear.act_quant import activation_quant, resolve_activation_quant

    g = torch.Generator().manual_seed(9)
    qweight, scales, mins, w = _int4(16, 96, 32, g)
    with pytest.raises(ValueError, match="int8 activations need K % 64 == 0"):
        avx2.linear_int4_a8(torch.randn(1, 96), qweight, scales, mins, 32)
    assert not avx2.should_use_int4_a8(torch.randn(1, 96), qweight, 32)
    layer = IntGroupWeightOnlyLinear(qweight, scales, mins, bits=4, group_size=32)
    assert resolve_activation_quant(torch.nn.Sequential(layer), "int8") == ("int8", 1)
    x = torch.randn(2, 96, generator=g)
    with activation_quant("int8"):
        y = layer(x)
    torch.testing.assert_close(y.double(), _a8_reference(x, w, None), rtol=1e-5, atol=1e-5)
