"""Every runtime weight format shards (column- and row-parallel) and stacks experts: the shards' outputs
concatenated or summed are the layer's, a stacked grouped forward is each expert's, and what cannot be split is
refused with the reason."""

from __future__ import annotations

import pytest
import torch

from leanlm.model.layers import Linear
from leanlm.model.linear.act_sparse import ActSparseLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.fp8 import FP8Linear
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.llm_int8 import LLMInt8Linear
from leanlm.model.linear.shard import COLUMN, ROW
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.linear.sparse24_quant import Sparse24Int4Linear, Sparse24Int8Linear
from leanlm.model.linear.stack import StackedLinear
from leanlm.model.linear.w8a8 import Int8DynamicActLinear

N, K = 64, 256


def _mask(g: torch.Generator) -> torch.Tensor:
    """uint8 [N, K / 8] with 2 of every 4 bits set."""
    nibbles = torch.tensor([3, 5, 6, 9, 10, 12], dtype=torch.uint8)
    pick = nibbles[torch.randint(0, 6, (N, K // 8, 2), generator=g)]
    return (pick[..., 0] | (pick[..., 1] << 4)).contiguous()


def _layer(fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    bias = randn(N)
    i8 = lambda *s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8)  # noqa: E731
    u8 = lambda hi, *s: torch.randint(0, hi, s, generator=g, dtype=torch.uint8)  # noqa: E731
    scales = lambda *s: randn(*s).abs() / 64 + 1e-3  # noqa: E731
    if fmt == "bf16":
        layer = Linear(K, N, dtype=torch.float32)
        with torch.no_grad():
            layer.weight.copy_(randn(N, K))
            layer.bias.copy_(bias)
        return layer
    if fmt == "int8":
        return Int8WeightOnlyLinear(i8(N, K), scales(N), bias)
    if fmt == "int8_group":
        return Int8WeightOnlyLinear(i8(N, K), scales(N, K // 32), bias, group_size=32)
    if fmt in ("int4", "int4_perm"):
        perm = torch.randperm(K, generator=g) if fmt == "int4_perm" else None
        return IntGroupWeightOnlyLinear(
            u8(256, N, K // 2), scales(N, K // 64), -scales(N, K // 64), bias, bits=4, group_size=64, perm=perm
        )
    if fmt == "w8a8":
        return Int8DynamicActLinear(i8(N, K), scales(N), bias)
    if fmt == "w8a8_group":
        return Int8DynamicActLinear(i8(N, K), scales(N, K // 64), bias, group_size=64)
    if fmt == "fp8":
        return FP8Linear((randn(N, K) * 4).to(torch.float8_e4m3fn), scales(N), bias)
    if fmt == "llm_int8":
        idx = torch.tensor([3, 100, 200])
        return LLMInt8Linear(i8(N, K), scales(N), idx, randn(N, 3), bias)
    if fmt == "act_sparse":
        linear = torch.nn.Linear(K, N)
        with torch.no_grad():
            linear.weight.copy_(randn(N, K))
        return ActSparseLinear.from_linear(linear, 0.5, column_scale=randn(K).abs() + 0.5)
    if fmt == "sparse24":
        return Sparse24Linear(randn(N, K // 2), _mask(g), bias)
    if fmt == "sparse24_int8":
        return Sparse24Int8Linear(i8(N, K // 2), _mask(g), scales(N, K // 64), bias, group_size=64)
    if fmt == "sparse24_int8_channel":
        return Sparse24Int8Linear(i8(N, K // 2), _mask(g), scales(N), bias)
    if fmt == "sparse24_int4":
        return Sparse24Int4Linear(
            u8(256, N, K // 4), _mask(g), scales(N, K // 64), u8(16, N, K // 64), bias, bits=4, group_size=64
        )
    if fmt == "bitmask":
        w = randn(N, K) * (torch.rand(N, K, generator=g) > 0.7)
        return BitmaskSparseLinear.from_dense(w, bias, torch.float32)
    raise AssertionError(fmt)


FORMATS = [
    "bf16", "int8", "int8_group", "int4", "int4_perm", "w8a8", "w8a8_group", "fp8", "llm_int8", "act_sparse",
    "sparse24", "sparse24_int8", "sparse24_int8_channel", "sparse24_int4", "bitmask",
]  # fmt: skip
ROW_SPLITTABLE = [f for f in FORMATS if f not in ("int4_perm", "w8a8", "w8a8_group", "fp8", "llm_int8")]


def _x(rows: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 4])
def test_column_shards_concatenated_are_the_layer(fmt, world):
    layer, x = _layer(fmt), _x()
    shards = [layer.shard(COLUMN, rank, world) for rank in range(world)]
    assert all(type(s) is type(layer) and (s.in_features, s.out_features) == (K, N // world) for s in shards)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([s(x) for s in shards], dim=-1), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ROW_SPLITTABLE)
@pytest.mark.parametrize("world", [2, 4])
def test_row_shards_summed_are_the_layer(fmt, world):
    layer, x = _layer(fmt), _x()
    shards = [layer.shard(ROW, rank, world) for rank in range(world)]
    assert all((s.in_features, s.out_features) == (K // world, N) for s in shards)
    assert [s.bias is not None for s in shards] == [True] + [False] * (world - 1)  # the bias is added once
    with torch.no_grad():
        parts = [s(x[:, rank * (K // world) : (rank + 1) * (K // world)]) for rank, s in enumerate(shards)]
        torch.testing.assert_close(torch.stack(parts).sum(0), layer(x), rtol=1e-4, atol=1e-4)


def test_bf16_column_shards_on_the_native_kernels_are_bit_identical():
    layer = _layer("bf16").to(torch.bfloat16)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    for rows in (3, 12):  # the few-row GEMV, the packed GEMM
        x = _x(rows).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(torch.cat([layer.shard(COLUMN, r, 2)(x) for r in range(2)], dim=-1), layer(x))


@pytest.mark.parametrize("fmt", ["w8a8", "fp8", "llm_int8"])
def test_per_token_activation_scales_refuse_a_row_split(fmt):
    with pytest.raises(ValueError, match="row-parallel.*activation scale"):
        _layer(fmt).shard(ROW, 0, 2)


def test_an_act_order_permutation_refuses_a_row_split():
    with pytest.raises(ValueError, match="act-order"):
        _layer("int4_perm").shard(ROW, 0, 2)


@pytest.mark.parametrize(
    "fmt, world",
    [("int8_group", 16), ("int4", 8), ("sparse24", 64), ("sparse24_int8", 8), ("sparse24_int4", 8), ("bitmask", 64)],
)
def test_a_cut_through_a_group_is_refused(fmt, world):
    with pytest.raises(ValueError, match="indivisible block"):
        _layer(fmt).shard(ROW, 0, world)


@pytest.mark.parametrize("axis, rank, world", [(2, 0, 2), (COLUMN, 2, 2), (COLUMN, 0, 0), (COLUMN, 0, 3)])
def test_bad_shard_arguments_are_refused(axis, rank, world):
    with pytest.raises(ValueError):
        _layer("int8").shard(axis, rank, world)


def test_a_shard_keeps_the_formats_settings():
    shard = _layer("int4").shard(ROW, 1, 2)
    assert shard.metadata() == {**_layer("int4").metadata(), "in_features": K // 2}


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bitmask"])
def test_stacked_grouped_forward_is_each_experts_forward(fmt):
    experts = [_layer(fmt, seed) for seed in range(3)]
    stacked = type(experts[0]).stack(experts)
    assert isinstance(stacked, StackedLinear) and stacked.num_experts == 3
    assert all(t.shape[0] == 3 for t in stacked.tensors.values())
    x = _x(11)
    ids = torch.tensor([2, 0, 0, 1, 2, 2, 0, 1, 1, 0, 2])
    y = stacked.reference_forward(x, ids)
    for e, layer in enumerate(experts):
        rows = (ids == e).nonzero().squeeze(1)
        with torch.no_grad():
            assert torch.equal(y[rows], layer.fallback(x[rows]))
        with torch.no_grad():
            assert torch.equal(stacked.expert(e)(x[rows]), layer(x[rows]))
    torch.testing.assert_close(stacked.dequantized_weights()[1], experts[1].dequantized_weight(), rtol=0, atol=0)


def test_experts_of_different_shapes_or_formats_do_not_stack():
    with pytest.raises(ValueError, match="one shape and dtype"):
        BitmaskSparseLinear.stack([_layer("bitmask", 0), _layer("bitmask", 1)])  # different nonzero counts
    with pytest.raises(ValueError, match="Int8WeightOnlyLinear layers only"):
        Int8WeightOnlyLinear.stack([_layer("int8"), _layer("w8a8")])
    with pytest.raises(ValueError, match="one format with one set of settings"):
        Int8WeightOnlyLinear.stack([_layer("int8"), _layer("int8_group")])
    with pytest.raises(ValueError, match="expert_ids"):
        Int8WeightOnlyLinear.stack([_layer("int8")]).reference_forward(_x(2), torch.tensor([0, 1]))
