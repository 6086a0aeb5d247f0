"""The dense float32 GEMV of the AVX2 level (gemv_f32_avx2.c) against float64 products, and a dense float32 model on
the float32 decode loop through it (up to 64 rows), against the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_decode, cpu_gemv_avx2
from leanlm.model.llama import build_model
from tests.conftest import tiny_state_dict
from tests.kernels.test_cpu_decode import _cache, _config, _decode

needs_kernel = pytest.mark.skipif(not cpu_gemv_avx2.is_available(), reason="the float32 GEMV needs AVX2")


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(1, 8), (37, 100), (96, 576), (40, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_matches_float64(n, k, m, with_bias):
    gen = torch.Generator().manual_seed(n * k + m)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(cpu_gemv_avx2.linear(x, w, bias).double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)


@needs_kernel
def test_wrong_tensors_are_clear_errors():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="x must be a contiguous float32"):
        cpu_gemv_avx2.linear(torch.randn(1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="x has shape"):
        cpu_gemv_avx2.linear(torch.randn(1, 32), w)
    assert cpu_gemv_avx2.native_call(w.bfloat16(), None) is None  # a bf16 weight: not this kernel's
    assert cpu_gemv_avx2.native_call(w.t(), None) is None  # not contiguous


@needs_kernel
@pytest.mark.skipif(not cpu_decode.is_available(torch.float32), reason="the float32 decode loop needs AVX2")
@pytest.mark.parametrize("batch", [1, 3, 24])  # 24 > 16: the rows the wider limit adds
def test_a_dense_float32_model_runs_the_loop(batch):
    cfg = _config("qwen2")  # q/k/v biases too
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    plan = model.native_decode_plan()
    assert plan.loop is not None and plan.loop.dtype is torch.float32 and plan.loop.max_rows == 64
    assert {linear.name for layer in plan.loop._keep[0] for linear in layer.linears} == {"f32"}
    blocks = max(64, 16 * batch)
    native = _decode(model, True, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    reference = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    torch.testing.assert_close(native, reference, rtol=2e-4, atol=2e-4)
