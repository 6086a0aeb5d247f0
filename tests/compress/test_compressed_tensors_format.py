"""Sparse checkpoints in the compressed-tensors layout: the tensors numpy.packbits and compressed-tensors'
compressors define, written and read back to the same model (2:4 and unstructured), and what is refused."""

import json

import numpy as np
import pytest
import torch

from leanlm.cli import main
from leanlm.compress import MagnitudeConfig, RTNConfig, compress
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.compressed_tensors import save_compressed_tensors_checkpoint
from leanlm.llm import load_model
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.bitmask_layout import (
    bitmask_layer_tensors,
    bitmask_tensors,
    from_bitmask_layer_tensors,
    from_bitmask_tensors,
    from_sparse24_tensors,
    pack_bits,
    sparse24_tensors,
    unpack_bits,
)
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.llama import build_model
from tests.compress.conftest import dense_logits
from tests.conftest import tiny_config, tiny_state_dict


def test_bits_pack_as_numpy_packbits_little():
    keep = torch.rand(5, 21, generator=torch.Generator().manual_seed(0)) > 0.5
    assert np.array_equal(pack_bits(keep).numpy(), np.packbits(keep.numpy(), axis=-1, bitorder="little"))
    assert torch.equal(unpack_bits(pack_bits(keep), 21), keep)


def test_2_4_tensors_are_the_layer_own_values_and_mask():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 32, generator=g).view(8, 8, 4)
    top = w.abs().topk(2, dim=-1).indices
    w = torch.zeros_like(w).scatter(-1, top, w.gather(-1, top)).view(8, 32).bfloat16()
    layer = Sparse24Linear.from_dense(w)
    tensors = sparse24_tensors(layer)
    keep = w != 0
    assert torch.equal(tensors["compressed"], w[keep].view(8, 16))  # compressed-tensors: tensor[mask] row-major
    assert torch.equal(tensors["bitmask"], pack_bits(keep)) and tensors["shape"].tolist() == [[8], [32]]
    assert torch.equal(from_sparse24_tensors(tensors).dequantized_weight(), w.float())


def test_unstructured_tensors_load_as_the_bitmask_layer_when_sparse_enough():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(6, 24, generator=g) * (torch.rand(6, 24, generator=g) > 0.8)).bfloat16()
    tensors = bitmask_tensors(w)
    layer = from_bitmask_layer_tensors(tensors)
    assert isinstance(layer, BitmaskSparseLinear) and torch.equal(layer.dequantized_weight(), w.float())
    assert all(torch.equal(a, b) for a, b in zip(bitmask_layer_tensors(layer).values(), tensors.values(), strict=True))
    no_offsets = {k: v for k, v in tensors.items() if k != "row_offsets"}  # optional: rebuilt from the mask
    assert torch.equal(from_bitmask_layer_tensors(no_offsets).row_offsets, tensors["row_offsets"])
    bad = {**tensors, "row_offsets": tensors["row_offsets"].flip(0)}
    with pytest.raises(ValueError, match="row_offsets"):
        from_bitmask_layer_tensors(bad)
    assert from_bitmask_layer_tensors(bitmask_tensors(torch.ones(6, 24))) is None  # dense: not worth it
    assert from_bitmask_layer_tensors(bitmask_tensors(torch.zeros(6, 20))) is None  # K % 8: no mask bytes


def test_unstructured_tensors_round_trip_and_checks():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 20, generator=g) * (torch.rand(6, 20, generator=g) > 0.7)
    tensors = bitmask_tensors(w)
    counts = (w != 0).sum(1)
    assert torch.equal(tensors["row_offsets"], torch.cumsum(counts, 0) - counts)
    assert torch.equal(from_bitmask_tensors(tensors), w)
    with pytest.raises(ValueError, match="values for a mask"):
        from_bitmask_tensors({**tensors, "compressed": tensors["compressed"][:-1]})


TARGETS = [dict(pattern="2:4"), dict(sparsity=0.6), dict(sparsity=0.5)]


@pytest.mark.parametrize("target", TARGETS, ids=["2:4", "60%", "50%"])
def test_a_pruned_model_round_trips_through_the_layout(tmp_path, tokenizer, target):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg, seed=4), torch.bfloat16)
    compress(model, MagnitudeConfig(**target), progress=False)
    path = save_compressed_tensors_checkpoint(Checkpoint(model, tokenizer), tmp_path / "ct")
    block = json.loads((path / "config.json").read_text())["quantization_config"]
    sparsity = block["sparsity_config"]
    assert block["quant_method"] == "compressed-tensors" and "config_groups" not in block
    assert sparsity["format"] == ("sparse-24-bitmask" if "pattern" in target else "sparse-bitmask")
    assert sparsity["ignore"] == ["lm_head"] and sparsity["targets"] == ["Linear"]
    loaded = load_model(str(path), dtype="bfloat16", progress=False)
    packed = sum(isinstance(m, Sparse24Linear) for m in loaded.modules())
    assert packed == (14 if "pattern" in target else 0)
    # 60% zeros pack (and load) as BitmaskSparseLinear; 50% stays a dense weight with zeros, as it was pruned
    unstructured = 14 if target.get("sparsity") == 0.6 else 0
    assert sum(isinstance(m, BitmaskSparseLinear) for m in model.modules()) == unstructured
    assert sum(isinstance(m, BitmaskSparseLinear) for m in loaded.modules()) == unstructured
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert torch.equal(dense_logits(loaded, ids), dense_logits(model, ids))


def test_quantized_or_dense_models_are_refused(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    with pytest.raises(ValueError, match="no pruned linear"):
        save_compressed_tensors_checkpoint(Checkpoint(model, tokenizer), tmp_path / "a")
    compress(model, RTNConfig(bits=8), progress=False)
    with pytest.raises(ValueError, match="quantized"):
        save_compressed_tensors_checkpoint(Checkpoint(model, tokenizer), tmp_path / "b")


def test_prune_command_writes_compressed_tensors(tmp_path, tokenizer, capsys):
    cfg = tiny_config(tokenizer.vocab_size)
    source, out = tmp_path / "dense", tmp_path / "ct"
    save_checkpoint(Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), source)
    argv = ["prune", "--model", str(source), "--method", "magnitude", "--pattern", "2:4"]
    assert main([*argv, "--format", "compressed-tensors", "--out", str(out), "--device", "cpu"]) == 0
    assert "compressed-tensors format" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not (out / "quantization_config.json").exists()
    assert main([*argv, "--format", "compressed-tensors", "--then-quantize", "rtn", "--out", str(tmp_path / "x")]) == 2
