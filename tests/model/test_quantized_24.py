"""Sparse24Int8Linear and Sparse24Int4Linear, the 2:4 formats with quantized kept weights: exact conversion from the
dense int8 / 2-4 bit layers (same dequantized weight bit for bit), the refusals (not 2:4, act-order columns,
group sizes the kernels cannot take, grids without an exact zero, untrusted tensors), every forward path (the
sparse kernels, the packed GEMM for 9+ rows, the dense codes on CPUs without VBMI2, float32), and a checkpoint
saved and loaded back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.kernels import cpu_gemm, cpu_sparse
from leanlm.kernels.build import NativeKernel
from leanlm.llm import load_model
from leanlm.model.linear.base import LINEAR_FORMATS
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.sparse24_quant import (
    Sparse24Int4Linear,
    Sparse24Int8Linear,
    pack_chunks,
    to_sparse24_quantized,
    unpack_chunks,
)
from leanlm.model.llama import build_model
from leanlm.model.quantized.numerics import pack_int4
from tests.conftest import tiny_config, tiny_state_dict


def _keep(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[N, K] bool: 2 of every 4 columns, with ~10% of groups thinned to 1 and ~5% to 0 kept weights."""
    keep = (torch.rand(n, k // 4, 4, generator=g).argsort(-1) < 2).reshape(n, k)
    thin = torch.rand(n, k // 4, generator=g).repeat_interleave(4, 1)
    first = keep & (keep.cumsum(1) % 2 == 1)
    return keep & ~((thin < 0.1) & first) & ~(thin < 0.05)


def _int8(n=64, k=256, group_size=None, seed=0, bias=True) -> Int8WeightOnlyLinear:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) * _keep(n, k, g)
    scales = torch.rand(n, 1 if group_size is None else k // group_size, generator=g) * 0.02 + 1e-3
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return Int8WeightOnlyLinear(codes, scales.squeeze(1) if group_size is None else scales, b, group_size=group_size)


def _int4(n=64, k=256, group_size=64, bits=4, seed=0, bias=True) -> IntGroupWeightOnlyLinear:
    """Asymmetric codes whose pruned entries hold each group's zero code (what RTN / GPTQ leave)."""
    g = torch.Generator().manual_seed(seed)
    zeros = torch.randint(0, 2**bits, (n, k // group_size), generator=g)
    codes = torch.randint(0, 2**bits, (n, k), generator=g)
    codes = torch.where(_keep(n, k, g), codes, zeros.repeat_interleave(group_size, 1))
    scales = torch.rand(n, k // group_size, generator=g) * 0.05 + 1e-3
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return IntGroupWeightOnlyLinear(
        pack_int4(codes), scales, -zeros.float() * scales, b, bits=bits, group_size=group_size
    )


DENSE = {
    "int8": lambda **kw: _int8(**kw),
    "int8-g64": lambda **kw: _int8(group_size=64, **kw),
    "int4-g64": lambda **kw: _int4(**kw),
    "int4-g128": lambda **kw: _int4(group_size=128, **kw),
    "int3-g64": lambda **kw: _int4(bits=3, **kw),
}


@pytest.mark.parametrize("kind", DENSE)
def test_conversion_keeps_the_dequantized_weight_bit_for_bit(kind):
    dense = DENSE[kind]()
    sparse = to_sparse24_quantized(dense)
    assert isinstance(sparse, Sparse24Int8Linear if kind.startswith("int8") else Sparse24Int4Linear)
    assert torch.equal(sparse.dequantized_weight(), dense.dequantized_weight())
    assert torch.equal(sparse.dense_layer().dequantized_weight(), dense.dequantized_weight())
    # kept codes only: half the int8 codes, a quarter of a byte per 4-bit weight, plus the mask
    k, n = dense.in_features, dense.out_features
    assert sparse.codes.numel() == n * k // (2 if kind.startswith("int8") else 4) and sparse.mask.numel() == n * k // 8


@pytest.mark.parametrize("kind", DENSE)
def test_metadata_and_tensors_rebuild_the_same_layer(kind):
    layer = to_sparse24_quantized(DENSE[kind]())
    meta, tensors = layer.metadata(), dict(layer.state_dict())
    rebuilt = LINEAR_FORMATS[meta["format"]].from_tensors(meta, tensors)
    assert all(torch.equal(t, rebuilt.state_dict()[n]) for n, t in tensors.items())
    assert torch.equal(rebuilt.dequantized_weight(), layer.dequantized_weight())


def test_chunk_packing_round_trips():
    codes = torch.randint(0, 16, (5, 96), dtype=torch.uint8)  # K = 192: 3 chunks of 32 kept codes
    packed = pack_chunks(codes)
    assert packed.shape == (5, 48) and torch.equal(unpack_chunks(packed), codes)
    assert int(packed[2, 16 + 4]) == int(codes[2, 32 + 4]) | int(codes[2, 32 + 20]) << 4


def test_what_cannot_be_converted_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="2:4"):  # 3 nonzeros in a group
        to_sparse24_quantized(Int8WeightOnlyLinear(torch.ones(4, 64, dtype=torch.int8), torch.ones(4)))
    with pytest.raises(ValueError, match="multiples of 64"):
        to_sparse24_quantized(_int8(group_size=32))
    with pytest.raises(ValueError, match="multiples of 64"):
        to_sparse24_quantized(_int4(group_size=32))
    permuted = _int4()
    permuted.perm = torch.randperm(permuted.in_features)
    with pytest.raises(ValueError, match="static groups"):
        to_sparse24_quantized(permuted)
    shifted = _int4()
    shifted.mins = shifted.mins + 1e-3  # w = q * s + min with no code at 0: pruned weights would not be 0
    with pytest.raises(ValueError, match="no exact 0"):
        to_sparse24_quantized(shifted)


def test_untrusted_tensors_are_checked_on_construction():
    layer = to_sparse24_quantized(_int4())
    t = dict(layer.state_dict())
    meta = layer.metadata()
    bad_mask = t["mask"].clone()
    bad_mask[3, 2] = 0xFF  # a nibble with 4 bits: the kernel would read past the row
    for edit, match in [
        ({"mask": bad_mask}, "exactly 2"),
        ({"zeros": t["zeros"] + 16}, "0-15"),
        ({"scales": t["scales"][:, :1]}, "scales"),
        ({"codes": t["codes"].view(torch.int8)}, "uint8"),
    ]:
        with pytest.raises(ValueError, match=match):
            Sparse24Int4Linear.from_tensors(meta, {**t, **edit})
    int8 = to_sparse24_quantized(_int8())
    with pytest.raises(ValueError, match="int8"):
        Sparse24Int8Linear.from_tensors(int8.metadata(), {**int8.state_dict(), "codes": int8.codes.view(torch.uint8)})


@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_bf16_forward_matches_the_dense_layer(kind, rows):
    """1-8 rows on the sparse kernels, within bf16 rounding of the dense layer; 9+ on the packed GEMM of the same
    dense codes, bit for bit."""
    dense = DENSE[kind](seed=rows)
    sparse = to_sparse24_quantized(dense)
    x = torch.randn(rows, dense.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    with torch.inference_mode():
        y, y_dense = sparse(x), dense(x)
    if rows >= cpu_gemm.MIN_ROWS and cpu_gemm.quant_is_available():
        assert torch.equal(y, y_dense) and sparse.packed.value is not None
    ref = x.double() @ dense.dequantized_weight().double().T + dense.bias.double()
    assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (y.double() - y_dense.double()).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("kind", ["int8-g64", "int4-g64"])
def test_without_vbmi2_the_dense_codes_give_the_dense_layers_numbers(kind, monkeypatch):
    dense = DENSE[kind]()
    sparse = to_sparse24_quantized(dense)
    for name in ("_INT8_KERNEL", "_INT4_KERNEL"):
        missing = NativeKernel(Path("unused.c"), "unused", [], None, cpu_needs=("no_such_cpu_flag",))
        monkeypatch.setattr(cpu_sparse, name, missing)
    assert not cpu_sparse.quant_is_available()
    x = torch.randn(2, dense.in_features).bfloat16()
    assert torch.equal(sparse(x), dense(x))
    assert sparse.dense.value is not None  # the dense layer ran
    native = sparse.native_linear()
    assert native is None or native.name == dense.native_linear().name


def test_float32_runs_on_the_dequantized_weight():
    dense = _int4(bias=False)
    sparse = to_sparse24_quantized(dense)
    x = torch.randn(3, dense.in_features)
    assert torch.allclose(sparse(x), x @ dense.dequantized_weight().T, atol=1e-5)


def test_a_checkpoint_with_2_4_quantized_layers_loads_back_identical(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg, seed=2), torch.bfloat16)
    mlp = model.model.layers[1].mlp
    mlp.up_proj = to_sparse24_quantized(_int4(n=mlp.up_proj.out_features, k=mlp.up_proj.in_features, bias=False))
    mlp.down_proj = to_sparse24_quantized(_int8(n=mlp.down_proj.out_features, k=mlp.down_proj.in_features, bias=False))
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    layers = json.loads((tmp_path / "quantization_config.json").read_text())["layers"]
    assert layers["model.layers.1.mlp.up_proj"]["format"] == "sparse24_int4"
    assert layers["model.layers.1.mlp.down_proj"]["format"] == "sparse24_int8"
    loaded = load_model(str(tmp_path), dtype="bfloat16", progress=False)
    for name in ("up_proj", "down_proj"):
        ours, theirs = getattr(mlp, name), getattr(loaded.model.layers[1].mlp, name)
        assert type(theirs) is type(ours)
        assert all(torch.equal(t, theirs.state_dict()[n]) for n, t in ours.state_dict().items())
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    from tests.compress.conftest import dense_logits

    with torch.inference_mode():
        assert torch.equal(dense_logits(loaded, ids), dense_logits(model, ids))
