"""Every runtime linear format on CUDA (the layers are device-agnostic): marked `gpu`, skipped without CUDA.

Each layer is built on the CPU and moved with `.to("cuda")`, as a loaded model is, and must give the CPU layer's
outputs; 2:4 layers with enough rows run on the sparse tensor cores and must match the widened weight's product.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leanlm.compress.quantize.int_scheme import IntScheme
from leanlm.compress.quantize.llm_int8 import llm_int8_linear
from leanlm.compress.quantize.rtn import quantize_rtn
from leanlm.model.linear import tensor_cores
from leanlm.model.linear.act_sparse import ActSparseLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.fp8 import FP8Linear
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.linear.sparse24_quant import to_sparse24_quantized
from leanlm.model.quantized.numerics import quantize_fp8, sqnr_db

pytestmark = pytest.mark.gpu

N, K = 128, 256
GEN = torch.Generator().manual_seed(0)


def _weight() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(N, K, generator=GEN) / K**0.5, torch.randn(N, generator=GEN) * 0.1


def _prune_24(w: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest of every 4 columns."""
    n, k = w.shape
    groups = w.reshape(n, k // 4, 4)
    keep = groups.abs().argsort(-1, descending=True).argsort(-1) < 2
    return (groups * keep).reshape(n, k)


def _layer(kind: str) -> torch.nn.Module:
    w, b = _weight()
    if kind in SCHEMES:
        return quantize_rtn(w, b, SCHEMES[kind])
    if kind == "fp8":
        return FP8Linear(*quantize_fp8(w, torch.float8_e4m3fn), b)
    if kind == "llm-int8":
        return llm_int8_linear(w, b, outlier_idx=torch.tensor([3, 70, 200]), threshold=1.0)
    if kind == "sparse24":
        return Sparse24Linear.from_dense(_prune_24(w), b, torch.float32)
    if kind == "bitmask":
        keep = w.abs() >= w.abs().flatten().kthvalue(int(0.7 * w.numel())).values
        return BitmaskSparseLinear.from_dense(w * keep, b, torch.float32)
    if kind in ("sparse24-int8", "sparse24-int4"):
        return to_sparse24_quantized(quantize_rtn(_prune_24(w), b, SCHEMES[kind.removeprefix("sparse24-")]))
    if kind == "act-sparse":
        linear = torch.nn.Linear(K, N)
        with torch.no_grad():
            linear.weight.copy_(w), linear.bias.copy_(b)
        return ActSparseLinear.from_linear(linear, threshold=0.5)
    raise AssertionError(kind)


SCHEMES = {
    "int8": IntScheme(bits=8, group_size=None),
    "int4": IntScheme(bits=4, group_size=64),
    "int3-g32": IntScheme(bits=3, group_size=32),
    "w8a8": IntScheme(bits=8, group_size=None, act_bits=8),
}
KINDS = [*SCHEMES, "fp8", "llm-int8", "sparse24", "bitmask", "sparse24-int8", "sparse24-int4", "act-sparse"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_each_format_on_cuda_gives_the_cpu_layers_outputs(kind, rows):
    layer = _layer(kind).set_compute_dtype(torch.float32)
    x = torch.randn(rows, K, generator=GEN)
    with torch.no_grad():
        expected = layer(x)
        gpu = layer.to("cuda")
        assert all(t.is_cuda for t in gpu.buffers()), "a buffer stayed on the CPU"
        y = gpu(x.cuda())
    assert y.is_cuda and y.shape == expected.shape
    assert sqnr_db(expected, y.cpu()) > 45  # float32 on both sides; different summation orders


@pytest.mark.parametrize("rows", [256, 1024])
def test_2_4_rows_on_the_sparse_tensor_cores_match_the_widened_weight(rows, monkeypatch):
    if not tensor_cores.is_available(torch.device("cuda")):
        pytest.skip("no sparse tensor cores (compute capability < 8.0)")
    monkeypatch.setattr(tensor_cores, "MIN_MACS", rows * N * K)  # these rows take the path, one row does not
    w, b = _weight()
    layer = Sparse24Linear.from_dense(_prune_24(w), b, torch.bfloat16).to("cuda")
    x = torch.randn(2, rows // 2, K, generator=GEN).bfloat16().cuda()
    with torch.no_grad():
        y = layer(x)
        assert layer.semi_structured.value is not None, "the rows did not take the sparse tensor cores"
        dense = F.linear(x.float(), layer.dense_weight().float(), layer.bias.float())
        fewer = layer(x[:, :1])  # below MIN_MACS: cuBLAS on the widened weight
    assert y.shape == (2, rows // 2, N) and y.dtype is torch.bfloat16
    assert sqnr_db(dense, y.float()) > 38  # bf16 output rounding
    assert torch.allclose(fewer.float(), dense[:, :1], rtol=2e-2, atol=2e-2)


def test_a_weight_the_tensor_cores_cannot_take_stays_on_the_dense_path(monkeypatch):
    monkeypatch.setattr(tensor_cores, "MIN_MACS", 0)
    w = torch.randn(48, 96, generator=GEN)  # 48 rows: not a multiple of 32
    layer = Sparse24Linear.from_dense(_prune_24(w), None, torch.bfloat16).to("cuda")
    x = torch.randn(512, 96, generator=GEN).bfloat16().cuda()
    with torch.no_grad():
        y = layer(x)
    assert layer.semi_structured.value is None
    assert torch.equal(y, F.linear(x, layer.dense_weight()))
