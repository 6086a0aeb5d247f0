"""WidenedSparseLinear, the routing the float sparse layers share (Sparse24Linear, BitmaskSparseLinear), tested on
both: few bf16 rows on the layer's kernel and 9+ on the packed GEMM give the dense bf16 Linear's numbers bit for
bit; a CPU without VBMI2 runs the widened copy with the same numbers; float32 and autograd run on the dense copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_bitmask, cpu_gemm, cpu_gemv, cpu_sparse
from leanlm.kernels.build import NativeKernel
from leanlm.model.layers import Linear
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.sparse24 import Sparse24Linear
from tests.kernels.test_cpu_bitmask import prune_unstructured
from tests.kernels.test_cpu_sparse import prune_24


def _24(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return prune_24(torch.randn(n, k, generator=g) / k**0.5, g)


def _unstructured(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return prune_unstructured(torch.randn(n, k, generator=g) / k**0.5, 0.8, g)


# layer class, its kernel module, its weights, K for the forward test (bitmask: K % 32 == 8, a kernel tail)
CASES = {
    "sparse24": (Sparse24Linear, cpu_sparse, _24, 576),
    "bitmask": (BitmaskSparseLinear, cpu_bitmask, _unstructured, 584),
}


def _dense_linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
    dense = Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(w)
        if b is not None:
            dense.bias.copy_(b)
    return dense


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_bf16_forward_equals_the_dense_layer(case, rows):
    """1-8 rows on the layer's kernel, 9+ on the packed GEMM: the dense bf16 Linear's numbers bit for bit."""
    cls, kernels, make, k = CASES[case]
    g = torch.Generator().manual_seed(rows)
    w, b = make(96, k, g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    layer, dense = cls.from_dense(w, b), _dense_linear(w, b)
    x = torch.randn(rows, k, generator=g).bfloat16()
    with torch.inference_mode():
        y = layer(x)
        assert torch.equal(y, dense(x))
    ref = F.linear(x.double(), w.double(), b.double())
    assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (layer.packed.value is not None) == (rows >= cpu_gemm.MIN_ROWS and cpu_gemm.is_available())
    if kernels.is_available() and cpu_gemm.is_available():  # no path kept a widened dense copy
        assert layer.dense.value is None


@pytest.mark.parametrize("case", CASES)
def test_without_vbmi2_the_dense_copy_gives_the_same_numbers(case, monkeypatch):
    cls, kernels, make, _ = CASES[case]
    g = torch.Generator().manual_seed(0)
    w, b = make(40, 128, g).bfloat16(), torch.randn(40).bfloat16()
    layer = cls.from_dense(w, b)
    x = torch.randn(2, 128).bfloat16()
    expected = layer(x)
    missing = NativeKernel(Path("unused.c"), "unused", [], None, cpu_needs=("avx512_bf16", "no_such_cpu_flag"))
    monkeypatch.setattr(kernels, "_KERNEL", missing)
    assert not kernels.is_available()
    assert torch.equal(layer(x), expected)
    assert layer.dense.value is not None  # the widened copy ran
    if cpu_gemv.is_available():
        assert torch.equal(layer(x), cpu_gemv.linear_bf16(x, w, b))


@pytest.mark.parametrize("case", CASES)
def test_float32_and_autograd_run_on_the_dense_copy(case):
    cls, _, make, _ = CASES[case]
    w, b = make(48, 64, torch.Generator().manual_seed(0)), torch.randn(48)
    layer = cls.from_dense(w, b, dtype=torch.float32)
    x = torch.randn(5, 64, requires_grad=True)
    y = layer(x)
    assert torch.allclose(y, F.linear(x, w, b), atol=1e-6)
    y.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(5, -1), atol=1e-6)
    bf16 = cls.from_dense(w, b).set_compute_dtype(torch.float32)  # the model's dtype decides
    assert bf16.values.dtype == torch.float32 and bf16.bias.dtype == torch.float32
    assert bf16(x).dtype == torch.float32
