"""The 2:4 sparse small-M linear kernel (gemv_sparse24.c): bit-identical to the bf16 GEMV kernel on the widened
weight (same fp32 sums in the same order), within bf16 output rounding of float64 math, on partial row blocks,
every K tail (K % 32 in 8, 16, 24), M = 1..8 and several passes, any thread count; argument checks and the
should_use policy; and the kernel refused where the CPU lacks a flag it needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leanlm.kernels import cpu_gemv, cpu_sparse
from leanlm.kernels.build import NativeKernel
from leanlm.model.linear.sparse24 import compress_24, widen_24
from tests.kernels.linear_inputs import EPS32, linear_inputs

pytestmark = pytest.mark.skipif(
    not cpu_sparse.is_available(), reason=f"CPU 2:4 sparse GEMV kernel: {cpu_sparse.unavailable_reason()}"
)


def prune_24(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """w [N, K] with 2 of every 4 columns kept at random, and some groups thinned to 1 or 0 nonzeros."""
    n, k = w.shape
    groups = w.reshape(n, k // 4, 4)
    keep = torch.rand(groups.shape, generator=g).argsort(-1)[..., :2]
    kept = torch.zeros_like(groups).scatter_(-1, keep, groups.gather(-1, keep))
    thin = torch.rand(n, k // 4, 1, generator=g)
    kept = kept * (thin > 0.1)  # ~10% empty groups
    first = kept.ne(0).int().argmax(-1, keepdim=True)
    return kept.scatter(-1, first, torch.where(thin > 0.9, 0.0, kept.gather(-1, first))).reshape(n, k)


def _inputs(M: int, N: int, K: int, has_bias: bool, seed: int):
    x, w, b = linear_inputs(M, N, K, has_bias, seed)
    w = prune_24(w, torch.Generator().manual_seed(seed))
    values, mask = compress_24(w)
    assert torch.equal(widen_24(values, mask), w)
    return x, w, values, mask, b


SHAPES = [(M, N, K) for M in range(1, 9) for N, K in ((37, 8), (64, 64), (576, 576), (67, 1536), (33, 24))]
SHAPES += [(M, 45, K) for M in (1, 3) for K in (40, 48, 56, 88, 104, 120)]  # tails of 8, 16, 24 after 32 or 64
SHAPES += [(11, 100, 96), (17, 40, 576), (1, 1536, 576), (2, 576, 1536)]  # several passes; big enough to thread


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_equals_the_bf16_kernel_on_the_dense_weight(M, N, K, has_bias):
    x, w, values, mask, b = _inputs(M, N, K, has_bias, seed=M * 1000 + N + K)
    y = cpu_sparse.linear_sparse24(x, values, mask, b)
    # Bit for bit: the widened slices are the dense weight's and every fp32 sum runs in gemv_bf16.c's order.
    assert torch.equal(y, cpu_gemv.linear_bf16(x, w, b))
    # And near float64 math: half a bf16 ulp of the result plus fp32 accumulation slack.
    ref = x.double() @ w.double().T + (0.0 if b is None else b.double())
    slack = (K // 16 + 64) * EPS32 * (x.double().abs() @ w.double().abs().T) + 2**-8 * ref.abs()
    assert ((y.double() - ref).abs() <= slack + 1e-30).all()


def test_leading_dimensions_and_a_zero_row():
    x, w, values, mask, b = _inputs(6, 50, 64, True, seed=1)
    y = cpu_sparse.linear_sparse24(x.view(2, 3, 64), values, mask, b)
    assert y.shape == (2, 3, 50) and torch.equal(y.view(6, 50), cpu_gemv.linear_bf16(x, w, b))
    zero = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_sparse.linear_sparse24(zero, values, mask, b), b[None])


def test_rows_do_not_depend_on_the_thread_count():
    x, _, values, mask, b = _inputs(5, 1536, 576, True, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_sparse.linear_sparse24(x, values, mask, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, cpu_sparse.linear_sparse24(x, values, mask, b))


def test_wrong_arguments_are_refused_with_a_message():
    x, _, values, mask, b = _inputs(2, 40, 64, True, seed=3)
    with pytest.raises(ValueError, match="mask has shape"):
        cpu_sparse.linear_sparse24(x, values, mask[:, :4].contiguous(), b)
    with pytest.raises(ValueError, match="x"):
        cpu_sparse.linear_sparse24(x[:, :32].contiguous(), values, mask, b)
    with pytest.raises(ValueError, match="values must be a contiguous bfloat16"):
        cpu_sparse.linear_sparse24(x, values.float(), mask, b)
    with pytest.raises(ValueError, match="mask must be a contiguous uint8"):
        cpu_sparse.linear_sparse24(x, values, mask.to(torch.int16), b)
    with pytest.raises(ValueError, match="bias has shape"):
        cpu_sparse.linear_sparse24(x, values, mask, b[:3].contiguous())
    odd = torch.zeros(4, 6, dtype=torch.bfloat16)  # K = 12: not a whole mask byte per 8 columns
    with pytest.raises(ValueError, match="8 \\| K"):
        cpu_sparse.linear_sparse24(torch.zeros(1, 12, dtype=torch.bfloat16), odd, torch.zeros(4, 1, dtype=torch.uint8))


def test_should_use_policy():
    x, _, values, mask, _ = _inputs(8, 40, 64, False, seed=4)
    assert cpu_sparse.should_use(x, values, mask)
    assert not cpu_sparse.should_use(torch.cat([x, x[:1]]), values, mask)  # 9 rows: the packed GEMM's
    assert not cpu_sparse.should_use(x.float(), values, mask)
    assert not cpu_sparse.should_use(x, values.float(), mask)
    assert not cpu_sparse.should_use(x.t().contiguous().t(), values, mask)  # not contiguous


def test_a_cpu_without_vbmi2_gets_no_kernel():
    """Cooper Lake has AVX512-BF16 but not VBMI2: the kernel must not load there (the layer then falls back)."""
    kernel = NativeKernel(
        Path(cpu_sparse.__file__).with_name("gemv_sparse24.c"),
        "leanlm_linear_sparse24",
        cpu_sparse._KERNEL.argtypes,
        cpu_sparse._KERNEL.restype,
        cpu_needs=("avx512_bf16", "no_such_cpu_flag"),
    )
    assert not kernel.is_available() and "no_such_cpu_flag" in kernel.unavailable_reason
    assert cpu_sparse._KERNEL.cpu_needs == ("avx512_bf16", "avx512_vbmi2")
