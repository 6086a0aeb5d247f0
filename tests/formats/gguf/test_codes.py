"""GGUF 4-bit linears kept as codes: every block format's runtime layer dequantizes exactly as gguf-py does,
llama's Q/K rows come out un-permuted and qwen2's biases stay on the layer, and a model built on the codes
computes what the dequantized model computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from leanlm.formats.gguf.codes import CODE_TYPES, INT8_TYPES, runtime_linear
from leanlm.formats.stored import read_checkpoint
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from tests.compress.conftest import dense_logits
from tests.loading.conftest import write_tiny_gguf

BLOCK = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q4_K: (256, 144), Q.Q8_0: (32, 34), Q.Q5_0: (32, 22), Q.Q6_K: (256, 210)}


def _random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random codes and 6-bit scales, with finite fp16 d (and m / dmin) of mixed signs and magnitudes."""
    rng = np.random.default_rng(seed)
    weights, nbytes = BLOCK[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    halves = 2 if qtype in (Q.Q4_0, Q.Q8_0, Q.Q5_0, Q.Q6_K) else 4  # bytes of fp16 fields in a block
    fp16 = (rng.standard_normal((rows, cols // weights, halves // 2)) * 0.01).astype(np.float16)
    at = slice(nbytes - 2, nbytes) if qtype == Q.Q6_K else slice(0, halves)  # Q6_K's d comes last
    blocks[..., at] = fp16.view(np.uint8).reshape(rows, cols // weights, halves)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(CODE_TYPES, key=int))
def test_layers_dequantize_exactly_as_gguf(qtype):
    rows, cols = 48, 512
    data = _random_blocks(qtype, rows, cols)
    layer = runtime_linear(qtype, data, (rows, cols))
    if qtype in INT8_TYPES:  # signed codes, one scale per 32 (Q6_K: 16)
        assert isinstance(layer, Int8WeightOnlyLinear) and layer.group_size == (16 if qtype == Q.Q6_K else 32)
        bound = {Q.Q5_0: 16, Q.Q6_K: 32, Q.Q8_0: 128}[qtype]
        assert layer.qweight.min() == -bound and layer.qweight.max() == bound - 1  # random codes span the range
    else:
        assert isinstance(layer, IntGroupWeightOnlyLinear) and layer.group_size == 32 and layer.bits == 4
    expected = torch.from_numpy(dequantize(data, qtype).reshape(rows, cols).copy())
    assert torch.equal(layer.dequantized_weight(), expected)


@pytest.mark.parametrize("qtype", sorted(CODE_TYPES, key=int))
def test_layers_built_a_few_rows_at_a_time_equal_one_call(qtype, monkeypatch):
    """Large tensors (a tied head of 151k rows) convert ROWS_PER_CALL rows at a time: the same layer, row for row."""
    from leanlm.formats.gguf import codes

    data = _random_blocks(qtype, 11, 512, seed=3)
    whole = runtime_linear(qtype, data, (11, 512)).dequantized_weight()
    monkeypatch.setattr(codes, "ROWS_PER_CALL", 4)  # 4 + 4 + 3 rows
    assert torch.equal(runtime_linear(qtype, data, (11, 512)).dequantized_weight(), whole)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_row_order_and_bias(qtype):
    data = _random_blocks(qtype, 8, 64)
    order = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    bias = torch.arange(8.0)
    layer = runtime_linear(qtype, data, (8, 64), row_order=order, bias=bias)
    expected = torch.from_numpy(dequantize(data, qtype).reshape(8, 64).copy())[order]
    assert torch.equal(layer.dequantized_weight(), expected) and torch.equal(layer.bias, bias)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])  # gguf-py cannot write Q6_K this narrow
def test_checkpoint_keeps_codes(tmp_path, arch, linear_type):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, arch, tied=False, linear_type=linear_type)
    codes = read_checkpoint(path, progress=False, dequantize_gguf=False)
    dense = read_checkpoint(path, progress=False)
    linears = {k.removesuffix(".weight") for k in expected if k.endswith("proj.weight") or k == "lm_head.weight"}
    assert set(codes.quantized) == linears
    assert not any(k.startswith(tuple(m + "." for m in linears)) for k in codes.state_dict)  # biases moved too
    for name, layer in codes.quantized.items():
        assert torch.equal(layer.dequantized_weight(), dense.state_dict[name + ".weight"]), name
        assert torch.equal(layer.dequantized_weight(), expected[name + ".weight"]), name
        if arch == "qwen2" and name.endswith(("q_proj", "k_proj", "v_proj")):
            assert torch.equal(layer.bias, dense.state_dict[name + ".bias"])
    # both models compute the same function: exactly the dense one's in float32 (the codes' reference path),
    # and close to it in bf16 (the int4 / int8 kernels: the GEMV for few rows, the packed GEMM for 9+)
    ids = torch.randint(0, codes.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    dense_net = build_model(dense.config, dense.state_dict, torch.float32, "cpu")
    with torch.inference_mode():
        reference = dense_logits(dense_net, ids)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
            net = build_model(codes.config, codes.state_dict, dtype, "cpu", quantized=codes.quantized)
            for rows in (ids[:1, :4], ids):  # 4 rows (GEMV) and 24 rows (packed GEMM)
                got = dense_logits(net, rows).float()
                torch.testing.assert_close(got, reference[: rows.shape[0], : rows.shape[1]], atol=tol, rtol=tol)


def test_a_tied_head_in_a_block_format_runs_on_the_embedding_codes(tmp_path):
    """SmolLM2's file: a Q8_0 token_embd tied as the head. The head becomes an int8 g32 layer on those codes
    (the config untied), the embedding stays a float lookup table, and both equal the dequantized file."""
    path = tmp_path / "tied.gguf"
    expected = write_tiny_gguf(path, "llama", tied=True, linear_type="Q4_1", embedding_type="Q8_0")
    codes = read_checkpoint(path, progress=False, dequantize_gguf=False)
    dense = read_checkpoint(path, progress=False)
    assert dense.config.tie_word_embeddings and not codes.config.tie_word_embeddings
    head = codes.quantized["lm_head"]
    assert isinstance(head, Int8WeightOnlyLinear) and head.group_size == 32
    embedding = expected["model.embed_tokens.weight"]
    assert torch.equal(head.dequantized_weight(), embedding)
    assert torch.equal(codes.state_dict["model.embed_tokens.weight"], embedding)
    ids = torch.randint(0, codes.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = dense_logits(build_model(dense.config, dense.state_dict, torch.float32, "cpu"), ids)
        net = build_model(codes.config, codes.state_dict, torch.float32, "cpu", quantized=codes.quantized)
        torch.testing.assert_close(dense_logits(net, ids), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q6_K, Q.F16])
def test_dequantize_tensor_is_gguf_dequantize(qtype, monkeypatch):
    """The loader's run-of-blocks dequantization gives gguf-py's values, across call boundaries too."""
    from gguf import GGML_QUANT_SIZES

    from leanlm.formats.gguf import tensors as gguf_loader

    monkeypatch.setattr(gguf_loader, "_BLOCKS_PER_CALL", 7)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = 12, 2 * max(block_size, 256)
    data = np.random.default_rng(3).integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    if qtype == Q.F16:
        data = data.view(np.float16)
    with np.errstate(all="ignore"):  # random fp16 scales include infinities and NaNs
        expected = dequantize(data, qtype)
        got = gguf_loader.dequantize_tensor(data, qtype)
    assert got.shape == expected.shape and np.array_equal(got, expected, equal_nan=True)


def test_the_bundled_file_runs_every_linear_and_its_head_on_codes(smollm):
    """SmolLM2's Q4_1 linears as int4 codes and its tied Q8_0 embedding as an int8 g32 head, each equal to the
    dequantized file, and the float32 model on them computes the dequantized model's logits."""
    codes = read_checkpoint(DEFAULT_MODEL, progress=False, dequantize_gguf=False)
    linears = [n for n in codes.quantized if n != "lm_head"]
    assert len(linears) == 210 and all(isinstance(codes.quantized[n], IntGroupWeightOnlyLinear) for n in linears)
    for name in linears:
        assert torch.equal(codes.quantized[name].dequantized_weight(), smollm.state_dict[name + ".weight"]), name
    head = codes.quantized["lm_head"]
    assert isinstance(head, Int8WeightOnlyLinear) and head.group_size == 32
    assert torch.equal(head.dequantized_weight(), smollm.state_dict["model.embed_tokens.weight"])
    assert smollm.config.tie_word_embeddings and not codes.config.tie_word_embeddings
    ids = torch.tensor([smollm.tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        reference = dense_logits(build_model(smollm.config, smollm.state_dict, torch.float32, "cpu"), ids)
        net = build_model(codes.config, codes.state_dict, torch.float32, "cpu", quantized=codes.quantized)
        torch.testing.assert_close(dense_logits(net, ids), reference, atol=1e-4, rtol=1e-4)
