"""The AVX512-VNNI W8A8 kernel against torch's int8 reference (`int8_matmul` on `quantize_per_token_int8`), bit
for bit: padded N and K, 1 to 100 rows, bias, extreme codes, all-zero rows; rows that do not depend on the
batch or the thread count; the packing layout; and the W8A8 layer, which routes bf16 rows to it and gives the
result of its torch path."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_w8a8
from leanlm.model.linear.w8a8 import Int8DynamicActLinear, int8_matmul
from leanlm.model.quantized.numerics import quantize_per_token_int8

pytestmark = pytest.mark.skipif(
    not cpu_w8a8.is_available(), reason=f"W8A8 kernel: {cpu_w8a8._KERNEL.unavailable_reason}"
)


def _inputs(M: int, N: int, K: int, has_bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, generator=g) / (127 * K**0.5)
    b = torch.randn(N, generator=g).to(torch.bfloat16) if has_bias else None
    return x, q, s, b


def _reference(x, q, s, b) -> torch.Tensor:
    """Int8DynamicActLinear's torch path: torch._int_mm, then * s_x * s_w + bias in float32, then bf16."""
    xq, xs = quantize_per_token_int8(x)
    y = int8_matmul(xq, xs, q, s)
    return (y if b is None else y + b.float()).to(torch.bfloat16)


@pytest.mark.parametrize(
    "M,N,K",
    [(1, 576, 576), (3, 192, 576), (8, 1536, 576), (12, 576, 1536), (13, 70, 33), (40, 31, 7), (100, 96, 896)]
    + [(5, 1, 4), (2, 65, 1)],
)
@pytest.mark.parametrize("has_bias", [False, True])
def test_equals_the_torch_int8_product(M, N, K, has_bias):
    x, q, s, b = _inputs(M, N, K, has_bias)
    y = cpu_w8a8.gemm(x, cpu_w8a8.pack(q, s, b))
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert torch.equal(y, _reference(x, q, s, b))


def test_extreme_codes_zero_rows_and_wide_activations():
    """Codes at -128 and 127 (u = 0 and 255 after the offset), an all-zero row (scale floor, zero output), and a
    row whose amax is far from the others (its own scale)."""
    x, q, s, _ = _inputs(6, 64, 260, False, seed=1)
    q[:8] = -128
    q[8:16] = 127
    x[2] = 0
    x[4] *= 1000
    y = cpu_w8a8.gemm(x, cpu_w8a8.pack(q, s))
    assert torch.equal(y, _reference(x, q, s, None))
    assert (y[2] == 0).all()


def test_a_row_does_not_depend_on_the_batch_or_threads():
    x, q, s, b = _inputs(29, 160, 576, True, seed=2)
    packed = cpu_w8a8.pack(q, s, b)
    batched = cpu_w8a8.gemm(x, packed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.cat([cpu_w8a8.gemm(x[i : i + 1], packed) for i in range(x.shape[0])])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, single)


def test_packed_layout():
    """Panel p, quad kq, column c holds codes W[32p + c, 4kq .. 4kq + 3] + 128; padding holds code 0."""
    q = (torch.arange(40 * 6) % 251 - 125).to(torch.int8).view(40, 6)
    packed = cpu_w8a8.pack(q, torch.ones(40))
    assert packed.data.shape == (2, 2, 32, 4) and packed.data.dtype == torch.uint8
    assert packed.data[1, 1, 3].tolist() == [int(q[35, 4]) + 128, int(q[35, 5]) + 128, 128, 128]
    assert packed.data[0, 0, 31].tolist() == [int(v) + 128 for v in q[31, :4]]
    assert (packed.data[1, :, 8:] == 128).all() and (packed.scales[40:] == 0).all()


def test_bad_arguments_are_refused():
    q = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 codes"):
        cpu_w8a8.pack(q.float(), torch.ones(4))
    with pytest.raises(ValueError, match="one per output column"):
        cpu_w8a8.pack(q, torch.ones(3))
    with pytest.raises(ValueError, match=r"bf16 CPU rows \[M, 8\]"):
        cpu_w8a8.gemm(torch.zeros(2, 9, dtype=torch.bfloat16), cpu_w8a8.pack(q, torch.ones(4)))


@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 7, 96)])
def test_the_layer_runs_the_kernel_and_gives_its_torch_result(shape, monkeypatch):
    _, q, s, b = _inputs(1, 50, 96, True, seed=3)
    layer = Int8DynamicActLinear(q, s, b).set_compute_dtype(torch.bfloat16)
    x = (torch.randn(*shape) * 2).to(torch.bfloat16)
    fast = layer(x)
    assert layer.packed.value is not None  # the kernel ran on the layer's packed copy
    monkeypatch.setattr(cpu_w8a8, "is_available", lambda: False)
    slow = layer(x)
    assert fast.shape == (*shape[:-1], 50) and torch.equal(fast, slow)
