"""The AVX512-BF16 many-row linear kernel on packed weights: float64 references within fp32 accumulation and
bf16 rounding, padded N and K, batch and thread invariance, the packing layout, and the Linear layer that
routes 9+ rows to it and repacks when its parameters change; its weight-only int4 / int8 entry point, bit for
bit the bf16 kernel on the dequantized weight, and the quantized layers that route batches to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_gemm, cpu_qgemv
from leanlm.model.layers import Linear
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.quantized.numerics import pack_int4
from tests.kernels.linear_inputs import EPS32, linear_inputs

pytestmark = pytest.mark.skipif(
    not cpu_gemm.is_available(), reason=f"CPU bf16 GEMM kernel: {cpu_gemm.unavailable_reason()}"
)

_inputs = linear_inputs


def _check_close_to_exact(y: torch.Tensor, x, w, b) -> None:
    """|y - exact| <= fp32 accumulation bound (each lane adds K / 2 pair products, two roundings per pair,
    then the bias) + half a bf16 ulp of the result (the final rounding)."""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T + (b.double() if b is not None else 0.0)
    magnitude = xd.abs() @ wd.abs().T + (b.double().abs() if b is not None else 0.0)
    bound = (x.shape[1] + 2) * EPS32 * magnitude
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
    err = (y.double() - exact).abs()
    assert (err <= bound + ulp / 2 + bound.max() * 1e-6).all(), float((err - bound - ulp / 2).max())


@pytest.mark.parametrize(
    "M,N,K",
    [(9, 576, 576), (12, 192, 576), (13, 1536, 576), (24, 576, 1536), (100, 96, 896), (37, 7, 100), (64, 33, 101)]
    + [(300, 100, 64), (9, 1, 2), (10, 65, 1)],
)
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_float64(M, N, K, has_bias):
    x, w, b = _inputs(M, N, K, has_bias)
    y = cpu_gemm.gemm(x, cpu_gemm.pack(w, b))
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    _check_close_to_exact(y, x, w, b)
    # and torch's own bf16 product, which rounds once from fp32 sums in another order
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=2**-7, atol=1e-2)


def test_packed_layout():
    """Panel p, pair kk, column c holds (W[32p + c, 2kk], W[32p + c, 2kk + 1]), zero-padded."""
    w = torch.arange(40 * 5, dtype=torch.float32).view(40, 5).to(torch.bfloat16)
    packed = cpu_gemm.pack(w)
    assert packed.data.shape == (2, 3, 32, 2) and packed.padded_in_features == 6
    assert packed.data[1, 2, 3, 0] == w[35, 4] and packed.data[1, 2, 3, 1] == 0  # K padded with a zero
    assert packed.data[0, 1, 31].tolist() == w[31, 2:4].tolist()
    assert (packed.data[1, :, 8:] == 0).all()  # rows 40..63 are padding


def test_rows_do_not_depend_on_the_batch_or_threads():
    """Every row is summed in the same order whatever M, its position and the thread count: bit-identical."""
    x, w, b = _inputs(50, 200, 576, True)
    packed = cpu_gemm.pack(w, b)
    full = cpu_gemm.gemm(x, packed)
    assert torch.equal(cpu_gemm.gemm(x[17:30].contiguous(), packed), full[17:30])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.gemm(x, packed), full)
    finally:
        torch.set_num_threads(threads)


def test_nan_and_inf_propagate():
    x, w, _ = _inputs(16, 64, 64, False)
    x[3, 5] = float("nan")
    x[4, 0] = float("inf")
    w[:, 0] = 1
    y = cpu_gemm.gemm(x, cpu_gemm.pack(w))
    assert y[3].isnan().all() and y[4].isinf().all() and y[5].isfinite().all()


def test_rejects_what_it_cannot_read():
    x, w, b = _inputs(16, 64, 64, True)
    with pytest.raises(ValueError, match="bf16 weight"):
        cpu_gemm.pack(w.float())
    with pytest.raises(ValueError, match="bias has shape"):
        cpu_gemm.pack(w, b[:10])
    packed = cpu_gemm.pack(w, b)
    with pytest.raises(ValueError, match="bf16 CPU rows"):
        cpu_gemm.gemm(x.float(), packed)
    with pytest.raises(ValueError, match="bf16 CPU rows"):
        cpu_gemm.gemm(x[:, :32].contiguous(), packed)


def test_should_use_policy():
    x, w, _ = _inputs(9, 64, 64, False)
    packed = cpu_gemm.pack(w)
    assert cpu_gemm.should_use(x, packed)
    assert not cpu_gemm.should_use(x[:8], packed)  # few rows: the GEMV kernel's
    assert not cpu_gemm.should_use(x, None)
    assert not cpu_gemm.should_use(x.float(), packed)
    assert not cpu_gemm.should_use(x.t(), cpu_gemm.pack(w[:, :9].contiguous()))  # not contiguous


def test_measured_peak_is_positive():
    assert cpu_gemm.measure_dot_peak(threads=1, seconds=0.01) > 1.0


def _linear(N: int, K: int, bias: bool) -> Linear:
    torch.manual_seed(0)
    return Linear(K, N, bias=bias).to(torch.bfloat16).requires_grad_(False)


def test_linear_routes_many_rows_to_the_packed_kernel():
    layer = _linear(96, 64, bias=True)
    x, *_ = _inputs(40, 96, 64, False)
    y = layer(x)
    assert layer.packed.value is not None
    assert torch.equal(y, cpu_gemm.gemm(x, cpu_gemm.pack(layer.weight, layer.bias)))
    torch.testing.assert_close(y.float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2**-7, atol=1e-2)
    small = _linear(96, 64, bias=True)
    small(x[:8])
    assert small.packed.value is None  # a batch-1..8 model never pays for the copy


@pytest.mark.parametrize("edit", ["in_place", "new_data", "new_parameter", "bias"])
def test_linear_repacks_when_its_parameters_change(edit):
    layer = _linear(64, 64, bias=True)
    x, *_ = _inputs(16, 64, 64, False)
    before = layer(x)
    with torch.no_grad():
        if edit == "in_place":
            layer.weight.mul_(2)
        elif edit == "new_data":
            layer.weight.data = layer.weight.data * 2
        elif edit == "new_parameter":
            layer.weight = torch.nn.Parameter(layer.weight * 2, requires_grad=False)
        else:
            layer.bias.add_(1)
    after = layer(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, cpu_gemm.gemm(x, cpu_gemm.pack(layer.weight, layer.bias)))


def test_linear_leaves_autograd_to_torch():
    layer = _linear(64, 64, bias=False).requires_grad_(True)
    x, *_ = _inputs(16, 64, 64, False)
    layer(x).float().sum().backward()
    assert layer.weight.grad is not None and layer.packed.value is None


# ------------------------------------------------------------------------------ weight-only int4 / int8


def _int4(N: int, K: int, group_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, K // group_size, generator=g) * 0.02  # fp32: q * scale rounds (as in RTN/GPTQ)
    mins = -torch.rand(N, K // group_size, generator=g) * 0.1
    return q, scales, mins


@pytest.mark.parametrize("M,N,K,group_size", [(9, 96, 64, 32), (40, 200, 576, 64), (13, 33, 128, 128), (64, 7, 96, 2)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_int4_is_the_bf16_gemm_on_the_dequantized_weight(M, N, K, group_size, has_bias):
    """Widened panels hold exactly cpu_qgemv.dequantize_int4's bf16 values, so the product is bit-identical."""
    q, scales, mins = _int4(N, K, group_size)
    x, _, b = _inputs(M, N, K, has_bias)
    packed = cpu_gemm.pack_quant(q, scales, mins, group_size, 4, b)
    w = cpu_qgemv.dequantize_int4(pack_int4(q), scales, mins, group_size)
    assert torch.equal(cpu_gemm.gemm_quant(x, packed), cpu_gemm.gemm(x, cpu_gemm.pack(w, b)))


@pytest.mark.parametrize("M,N,K", [(9, 96, 64), (30, 70, 577), (100, 40, 1536)])
def test_int8_is_the_bf16_gemm_on_the_dequantized_weight(M, N, K):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) * 0.01
    x, _, b = _inputs(M, N, K, True)
    packed = cpu_gemm.pack_quant(q, scales[:, None], None, K, 8, b)
    w = cpu_qgemv.dequantize_int8(q, scales)
    assert torch.equal(cpu_gemm.gemm_quant(x, packed), cpu_gemm.gemm(x, cpu_gemm.pack(w, b)))


@pytest.mark.parametrize("M,N,K,group_size", [(9, 96, 64, 32), (40, 70, 576, 32), (17, 40, 1536, 64), (12, 33, 96, 16)])
def test_int8_group_wise_is_the_bf16_gemm_on_the_dequantized_weight(M, N, K, group_size):
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, K // group_size, generator=g) * 0.01
    x, _, b = _inputs(M, N, K, True)
    packed = cpu_gemm.pack_quant(q, scales, None, group_size, 8, b)
    w = cpu_qgemv.dequantize_int8(q, scales, group_size)
    assert torch.equal(cpu_gemm.gemm_quant(x, packed), cpu_gemm.gemm(x, cpu_gemm.pack(w, b)))


def test_pack_quant_rejects_bad_shapes():
    q, scales, mins = _int4(32, 64, 32)
    with pytest.raises(ValueError, match="group_size"):
        cpu_gemm.pack_quant(q, scales, mins, 24, 4)
    with pytest.raises(ValueError, match="do not match"):
        cpu_gemm.pack_quant(q, scales[:, :1], mins[:, :1], 32, 4)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        cpu_gemm.pack_quant(q, scales, mins, 32, 3)


def test_quantized_layers_route_batches_to_the_packed_gemm():
    q, scales, mins = _int4(64, 128, 32)
    layer = IntGroupWeightOnlyLinear(pack_int4(q), scales, mins, bits=4, group_size=32)
    x, *_ = _inputs(16, 64, 128, False)
    y = layer(x)
    assert layer.packed.value is not None
    assert torch.equal(y, cpu_gemm.gemm_quant(x, cpu_gemm.pack_quant(q, scales, mins, 32, 4)))
    torch.testing.assert_close(y.float(), layer.reference_forward(x).float(), rtol=2**-7, atol=1e-2)
    with torch.no_grad():
        layer.scales.mul_(2)  # an in-place edit: the packed copy is remade
    torch.testing.assert_close(layer(x).float(), layer.reference_forward(x).float(), rtol=2**-7, atol=1e-2)
    for int8 in (
        Int8WeightOnlyLinear(q.to(torch.int8) - 8, scales[:, 0]),
        Int8WeightOnlyLinear(q.to(torch.int8) - 8, scales, group_size=32),
    ):
        torch.testing.assert_close(int8(x).float(), int8.reference_forward(x).float(), rtol=2**-7, atol=1e-2)
        assert int8.packed.value is not None
