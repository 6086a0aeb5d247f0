"""The unstructured-sparse small-M linear kernel (gemv_bitmask.c): bit-identical to the bf16 GEMV kernel on the
widened weight (same fp32 sums in the same order), within bf16 output rounding of float64 math, at 0-100% zeros,
with a fully-zero row, every K tail (K % 32 in 8, 16, 24), M = 1..8 and several passes, 1 and 2 threads; argument
checks and the should_use policy; and the kernel refused where the CPU lacks a flag it needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leanlm.kernels import cpu_bitmask, cpu_gemv
from leanlm.kernels.build import NativeKernel
from leanlm.model.linear.bitmask import compress_bitmask, widen_bitmask
from tests.kernels.linear_inputs import EPS32, linear_inputs

pytestmark = pytest.mark.skipif(
    not cpu_bitmask.is_available(), reason=f"CPU bitmask sparse GEMV kernel: {cpu_bitmask.unavailable_reason()}"
)


def prune_unstructured(w: torch.Tensor, sparsity: float, g: torch.Generator) -> torch.Tensor:
    """w [N, K] with about `sparsity` of its entries zeroed at random (rows keep different counts), row 1 all zero."""
    w = w * (torch.rand(w.shape, generator=g) >= sparsity)
    if w.shape[0] > 1:
        w[1] = 0
    return w


def _inputs(M: int, N: int, K: int, has_bias: bool, sparsity: float, seed: int):
    x, w, b = linear_inputs(M, N, K, has_bias, seed)
    w = prune_unstructured(w, sparsity, torch.Generator().manual_seed(seed))
    values, mask, row_offsets = compress_bitmask(w)
    assert torch.equal(widen_bitmask(values, mask), w)
    return x, w, values, mask, row_offsets, b


SPARSITIES = [0.0, 0.5, 0.7, 0.95, 1.0]
SHAPES = [(M, N, K) for M in (1, 2, 5, 8) for N, K in ((37, 8), (64, 64), (67, 576), (33, 24))]
SHAPES += [(M, 45, K) for M in (1, 3) for K in (40, 48, 56, 88, 104, 120)]  # tails of 8, 16, 24 after 32 or 64
SHAPES += [(11, 100, 96), (1, 1536, 576), (2, 576, 1536)]  # several passes; big enough to thread


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize(("M", "N", "K"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_equals_the_bf16_kernel_on_the_dense_weight(M, N, K, sparsity, has_bias):
    x, w, values, mask, row_offsets, b = _inputs(M, N, K, has_bias, sparsity, seed=M * 1000 + N + K)
    y = cpu_bitmask.linear_bitmask(x, values, mask, row_offsets, b)
    # Bit for bit: the widened slices are the dense weight's and every fp32 sum runs in gemv_bf16.c's order.
    assert torch.equal(y, cpu_gemv.linear_bf16(x, w, b))
    # And near float64 math: half a bf16 ulp of the result plus fp32 accumulation slack.
    ref = x.double() @ w.double().T + (0.0 if b is None else b.double())
    slack = (K // 16 + 64) * EPS32 * (x.double().abs() @ w.double().abs().T) + 2**-8 * ref.abs()
    assert ((y.double() - ref).abs() <= slack + 1e-30).all()
    if N > 1:  # the fully-zero row gives the bias alone
        assert torch.equal(y[:, 1], torch.zeros(M, dtype=torch.bfloat16) if b is None else b[1].expand(M))


def test_leading_dimensions_and_a_zero_input():
    x, w, values, mask, row_offsets, b = _inputs(6, 50, 64, True, 0.7, seed=1)
    y = cpu_bitmask.linear_bitmask(x.view(2, 3, 64), values, mask, row_offsets, b)
    assert y.shape == (2, 3, 50) and torch.equal(y.view(6, 50), cpu_gemv.linear_bf16(x, w, b))
    zero = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_bitmask.linear_bitmask(zero, values, mask, row_offsets, b), b[None])


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_rows_do_not_depend_on_the_thread_count(sparsity):
    x, _, values, mask, row_offsets, b = _inputs(5, 1536, 576, True, sparsity, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_bitmask.linear_bitmask(x, values, mask, row_offsets, b)
        torch.set_num_threads(2)
        two = cpu_bitmask.linear_bitmask(x, values, mask, row_offsets, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_wrong_arguments_are_refused_with_a_message():
    x, _, values, mask, row_offsets, b = _inputs(2, 40, 64, True, 0.7, seed=3)
    with pytest.raises(ValueError, match="x .* does not match mask"):
        cpu_bitmask.linear_bitmask(x, values, mask[:, :4].contiguous(), row_offsets, b)
    with pytest.raises(ValueError, match="row_offsets has shape"):
        cpu_bitmask.linear_bitmask(x, values, mask, row_offsets[:5].contiguous(), b)
    with pytest.raises(ValueError, match="values must be a contiguous bfloat16"):
        cpu_bitmask.linear_bitmask(x, values.float(), mask, row_offsets, b)
    with pytest.raises(ValueError, match="mask must be a contiguous uint8"):
        cpu_bitmask.linear_bitmask(x, values, mask.to(torch.int16), row_offsets, b)
    with pytest.raises(ValueError, match="row_offsets must be a contiguous int64"):
        cpu_bitmask.linear_bitmask(x, values, mask, row_offsets.int(), b)
    with pytest.raises(ValueError, match="bias has shape"):
        cpu_bitmask.linear_bitmask(x, values, mask, row_offsets, b[:3].contiguous())
    with pytest.raises(ValueError, match="values has shape .*, expected \\[nnz\\]"):
        cpu_bitmask.linear_bitmask(x, values.view(1, -1), mask, row_offsets, b)


def test_should_use_policy():
    x, _, values, mask, row_offsets, _ = _inputs(8, 40, 64, False, 0.7, seed=4)
    assert cpu_bitmask.should_use(x, values, mask, row_offsets)
    assert not cpu_bitmask.should_use(torch.cat([x, x[:1]]), values, mask, row_offsets)  # 9 rows: cpu_gemm's
    assert not cpu_bitmask.should_use(x.float(), values, mask, row_offsets)
    assert not cpu_bitmask.should_use(x, values.float(), mask, row_offsets)
    assert not cpu_bitmask.should_use(x, values, mask, row_offsets.int())
    assert not cpu_bitmask.should_use(x.t().contiguous().t(), values, mask, row_offsets)  # not contiguous


def test_a_cpu_without_vbmi2_gets_no_kernel():
    """Cooper Lake has AVX512-BF16 but not VBMI2: the kernel must not load there (the layer then falls back)."""
    kernel = NativeKernel(
        Path(cpu_bitmask.__file__).with_name("gemv_bitmask.c"),
        "leanlm_linear_bitmask",
        cpu_bitmask._KERNEL.argtypes,
        cpu_bitmask._KERNEL.restype,
        cpu_needs=("avx512_bf16", "no_such_cpu_flag"),
    )
    assert not kernel.is_available() and "no_such_cpu_flag" in kernel.unavailable_reason
    assert cpu_bitmask._KERNEL.cpu_needs == ("avx512_bf16", "avx512_vbmi2")
