"""The AVX512-BF16 small-M linear kernel: float64 references within bf16 rounding, F.linear within a couple
of ulps, exact round-to-nearest-even ties, thread-count invariance, the should_use policy, the build cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_gemv
from tests.kernels.linear_inputs import EPS32, linear_inputs

pytestmark = pytest.mark.skipif(
    not cpu_gemv.is_available(), reason=f"CPU bf16 GEMV kernel: {cpu_gemv.unavailable_reason()}"
)

_inputs = linear_inputs


def _reference(x, w, b, depth: int | None = None):
    """Exact (float64) result, and a bound on fp32 accumulation error: depth * eps * sum |terms|, where
    depth is the longest chain of roundings a term passes through (K bounds any summation order)."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (b.double() if b is not None else 0.0)
    magnitude = xd.abs() @ wd.abs().T + (b.double().abs() if b is not None else 0.0)
    return ref, (depth or x.shape[1]) * EPS32 * magnitude


def _kernel_depth(K: int) -> int:
    """The kernel's chain: one of 16 fp32 lanes accumulates K / 32 pair-sums, a 16-lane tree, the bias."""
    return -(-K // 32) * 2 + 4 + 1 + 1


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |v| (8 significant bits)."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


SHAPES = [
    (M, N, K) for M in (1, 2, 3, 8) for K in (576, 1536, 896, 100) for N in (192, 576, 1536, 49152, 7) if N != 49152
] + [(1, 49152, 576), (8, 49152, 576), (3, 49152, 100)]  # lm_head-sized N: a few cases, they take seconds


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_matches_float64_and_f_linear(M, N, K, has_bias):
    x, w, b = _inputs(M, N, K, has_bias)
    y = cpu_gemv.linear_bf16(x, w, b)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16

    ref, accumulation = _reference(x, w, b, depth=_kernel_depth(K))
    # The exact sum, perturbed by fp32 accumulation, then rounded once to bf16 (half an ulp).
    err = (y.double() - ref).abs()
    assert (err <= 0.5 * _bf16_ulp(ref).double() * (1 + 2**-7) + accumulation).all(), err.max()

    # F.linear sums in another order: allow 2 ulps, plus accumulation slack where the sum cancels.
    _, accumulation = _reference(x, w, b)
    expected = F.linear(x, w, b).double()
    diff = (y.double() - expected).abs()
    assert (diff <= 2 * _bf16_ulp(expected).double() + 2 * accumulation).all(), diff.max()


def test_rounds_ties_to_even():
    # bf16 spacing at 1 is 2^-7: 1 + 2^-8 is a tie between 1 (even) and 1 + 2^-7 (odd) -> 1;
    # 1 + 3 * 2^-8 is a tie between 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> 1 + 2^-6.
    x = torch.tensor([[1.0, 2.0**-8], [1.0, 3 * 2.0**-8], [-1.0, -(2.0**-8)]], dtype=torch.bfloat16)
    w = torch.ones(1, 2, dtype=torch.bfloat16)
    y = cpu_gemv.linear_bf16(x, w)
    assert y.flatten().tolist() == [1.0, 1.0 + 2.0**-6, -1.0]
    assert torch.equal(y, F.linear(x, w))


def test_nan_propagates():
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 5] = float("nan")
    assert cpu_gemv.linear_bf16(x, torch.ones(3, 64, dtype=torch.bfloat16)).isnan().all()


def test_thread_count_does_not_change_results():
    x, w, b = _inputs(3, 1536, 576, has_bias=True, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.linear_bf16(x, w, b)
        torch.set_num_threads(2)
        two = cpu_gemv.linear_bf16(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_leading_dims_and_many_rows():
    x, w, b = _inputs(11, 200, 96, has_bias=True, seed=2)  # 11 rows: two passes over W
    y = cpu_gemv.linear_bf16(x, w, b)
    ref, accumulation = _reference(x, w, b)
    assert ((y.double() - ref).abs() <= _bf16_ulp(ref).double() + accumulation).all()
    x3 = x[:10].reshape(2, 5, 96)
    assert torch.equal(cpu_gemv.linear_bf16(x3, w, b), y[:10].reshape(2, 5, 200))


def test_rejects_what_it_cannot_read():
    x, w, b = _inputs(2, 64, 128, has_bias=True)
    with pytest.raises(ValueError, match="does not match"):
        cpu_gemv.linear_bf16(x[:, :100].contiguous(), w)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_gemv.linear_bf16(x.t().contiguous().t(), w)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemv.linear_bf16(x.float(), w)
    with pytest.raises(ValueError, match="bias"):
        cpu_gemv.linear_bf16(x, w, b[:10])


def test_should_use_policy():
    x, w, _ = _inputs(4, 64, 128, has_bias=False)
    assert cpu_gemv.should_use(x, w)
    assert cpu_gemv.should_use(x[:1], w)
    assert not cpu_gemv.should_use(x.t().contiguous().t(), w)  # non-contiguous x
    assert not cpu_gemv.should_use(x, w.t().contiguous().t())  # non-contiguous weight
    assert not cpu_gemv.should_use(x.float(), w.float())
    assert not cpu_gemv.should_use(x[:, :100], w)  # K mismatch
    assert not cpu_gemv.should_use(torch.zeros(9, 128, dtype=torch.bfloat16), w)  # M > MAX_ROWS
    assert cpu_gemv.should_use(torch.zeros(2, 4, 128, dtype=torch.bfloat16), w)  # 8 rows in all


def test_one_openmp_runtime_in_process():
    cpu_gemv.linear_bf16(*_inputs(1, 64, 64, has_bias=False)[:2])
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp
