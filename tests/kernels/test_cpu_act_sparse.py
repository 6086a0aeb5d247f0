"""The activation-sparse small-M linear kernel (gemv_act_sparse.c): within bf16 output rounding of float64 math
on the sparsified input (magnitude and weight-aware scores), rows independent of the batch, the weight rows of
zeroed inputs never read, argument checks and the should_use policy."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_act_sparse
from tests.kernels.linear_inputs import linear_inputs

pytestmark = pytest.mark.skipif(
    not cpu_act_sparse.is_available(), reason=f"CPU activation-sparse kernel: {cpu_act_sparse.unavailable_reason()}"
)


def _inputs(M, N, K, has_bias, seed=0, sparsity=0.4):
    x, w, b = linear_inputs(M, N, K, has_bias, seed)
    threshold = float(x.float().abs().flatten().kthvalue(max(1, int(sparsity * x.numel()))).values)
    return x, w.t().contiguous(), threshold, b


SHAPES = [(M, N, K) for M in range(1, 10) for N, K in ((37, 8), (64, 64), (576, 192), (1536, 576), (576, 1536))]


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_equals_float64_math_on_the_sparsified_input(M, N, K, has_bias):
    x, wt, threshold, b = _inputs(M, N, K, has_bias, seed=M * N + K)
    y = cpu_act_sparse.linear_act_sparse(x, wt, threshold, bias=b)
    xs = cpu_act_sparse.sparsify(x, threshold)
    assert 0.3 < float((xs == 0).float().mean()) < 0.5
    ref = xs.double() @ wt.double() + (0 if b is None else b.double())
    # one bf16 rounding of an fp32 sum: half an ulp of |y| plus the fp32 error of K terms
    bound = ref.abs() * 2.0**-8 + (xs.double().abs() @ wt.double().abs()) * K * 2.0**-24
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_the_same_alone_or_in_a_batch(threads):
    x, wt, threshold, b = _inputs(8, 1536, 576, True, seed=7)
    kept = cpu_act_sparse.sparsify(x, threshold) != 0
    # the batch keeps > 90% of the weight rows (the kernel walks them one at a time), each row alone < 90% (walked
    # in groups of 8): the two walks must give the same bits
    assert float(kept.any(0).float().mean()) > 0.9 and float(kept.float().mean(1).max()) < 0.9
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        batch = cpu_act_sparse.linear_act_sparse(x, wt, threshold, bias=b)
        for t in range(8):  # alone, a row reads fewer weight rows: the skipped ones only ever added zeros
            alone = cpu_act_sparse.linear_act_sparse(x[t : t + 1], wt, threshold, bias=b)
            assert torch.equal(alone, batch[t : t + 1])
    finally:
        torch.set_num_threads(before)


def test_both_walks_sum_the_rows_in_increasing_k():
    """Each output of column n sums 256, 1 and seven 2^-16 in a per-column order, through 9 kept rows (a group of
    8 and one more). In fp32, in increasing k, 2^-16 added to 256 or 257 rounds away (a tie to even) unless the
    tiny terms come first; 257 rounds to bf16 256 and anything above it to 258. So the output's bits tell the
    order apart. Alone, row 0 keeps 9 of 32 inputs (the grouped walk); beside a row that keeps all 32, the
    single walk. Both must give the float32 sum in increasing k."""
    K, N = 32, 64
    gen = torch.Generator().manual_seed(11)
    terms = torch.tensor([256.0, 1.0] + [2.0**-16] * 7)
    wt = torch.randn(K, N, generator=gen)
    for n in range(N):
        wt[:9, n] = terms[torch.randperm(9, generator=gen)]
    wt = wt.bfloat16()
    x = torch.zeros(2, K)
    x[0, :9], x[1] = 1.0, 2.0
    x = x.bfloat16()
    expected = torch.zeros(N, dtype=torch.float32)
    for k in range(9):  # the float32 sum in increasing k (the products by 1 are exact)
        expected = expected + wt[k].float()
    expected = expected.bfloat16()
    assert 0 < int((expected == 256).sum()) < N  # both outcomes occur: the test can tell orders apart
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one part: the sum in k order, not split
        alone = cpu_act_sparse.linear_act_sparse(x[:1], wt.contiguous(), 0.5)
        batch = cpu_act_sparse.linear_act_sparse(x, wt.contiguous(), 0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], expected) and torch.equal(batch[0], expected)


def test_the_weight_aware_score_thresholds_x_times_the_column_scale():
    x, wt, _, b = _inputs(2, 96, 128, True, seed=9)
    scale = torch.rand(128) * 2
    threshold = float((x.float().abs() * scale).flatten().median())
    y = cpu_act_sparse.linear_act_sparse(x, wt, threshold, scale, b)
    xs = cpu_act_sparse.sparsify(x, threshold, scale)
    assert torch.equal(xs == 0, x.float().abs() * scale <= threshold)
    ref = xs.double() @ wt.double() + b.double()
    bound = ref.abs() * 2.0**-8 + (xs.double().abs() @ wt.double().abs()) * 128 * 2.0**-24
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_the_weight_rows_of_zeroed_inputs_are_not_read():
    x, wt, threshold, _ = _inputs(1, 64, 128, False, seed=3)
    skipped = x[0].float().abs() <= threshold
    poisoned = wt.clone()
    poisoned[skipped] = float("nan")
    y = cpu_act_sparse.linear_act_sparse(x, poisoned, threshold)
    assert torch.isfinite(y).all() and torch.equal(y, cpu_act_sparse.linear_act_sparse(x, wt, threshold))


def test_threshold_zero_is_the_dense_product_and_leading_dimensions_work():
    x, wt, _, b = _inputs(6, 40, 64, True, seed=4)
    y = cpu_act_sparse.linear_act_sparse(x.view(2, 3, 64), wt, 0.0, bias=b)
    ref = x.double() @ wt.double() + b.double()
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.view(6, 40).double(), ref, rtol=2**-7, atol=1e-2)


def test_the_pytorch_reference_agrees():
    x, wt, threshold, b = _inputs(3, 96, 256, True, seed=5)
    y = cpu_act_sparse.linear_act_sparse(x, wt, threshold, bias=b)
    ref = cpu_act_sparse.reference(x.float(), wt.float(), threshold, None, b.float())
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=2e-2)


def test_wrong_arguments_are_refused_and_the_policy():
    x, wt, threshold, b = _inputs(2, 16, 32, True)
    with pytest.raises(ValueError, match="weight_t"):
        cpu_act_sparse.linear_act_sparse(x, wt.t(), threshold)  # not contiguous
    with pytest.raises(ValueError, match="x must be a contiguous bfloat16"):
        cpu_act_sparse.linear_act_sparse(x.float(), wt, threshold)
    assert cpu_act_sparse.should_use(x, wt, None, b)
    assert not cpu_act_sparse.should_use(x.repeat(5, 1), wt, None, b)  # 10 rows: the PyTorch path's business
    assert not cpu_act_sparse.should_use(x.float(), wt, None, b)
    assert not cpu_act_sparse.should_use(x, wt, None, b.float())
    assert not cpu_act_sparse.should_use(x, wt, torch.ones(31), b)
