"""BitmaskSparseLinear, the unstructured sparse runtime format: exact compress / widen round trips, the errors for
K not a multiple of 8 and for untrusted tensors, and a checkpoint saved and loaded back. The forward paths it shares
with Sparse24Linear (its kernel, the packed GEMM, a CPU without VBMI2, float32 and autograd) are tested in
test_widened.py."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.llm import load_model
from leanlm.model.linear.base import LINEAR_FORMATS
from leanlm.model.linear.bitmask import BitmaskSparseLinear, compress_bitmask, to_bitmask, widen_bitmask
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict
from tests.kernels.test_cpu_bitmask import prune_unstructured


def _weight(n: int = 48, k: int = 64, sparsity: float = 0.7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return prune_unstructured(torch.randn(n, k, generator=g) / k**0.5, sparsity, g)


def test_compress_and_widen_round_trip_exactly():
    w = _weight()
    w[0, :8] = torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0])
    values, mask, row_offsets = compress_bitmask(w, torch.float32)
    nnz = int((w != 0).sum())
    assert values.shape == (nnz,) and mask.shape == (48, 8) and mask.dtype == torch.uint8
    assert row_offsets.dtype == torch.int64 and row_offsets[0] == 0 and row_offsets[2] == row_offsets[1]  # row 1: 0s
    assert mask[0, 0] == 0b1000_0010 and values[:2].tolist() == [2.0, 3.0]  # bit i of byte b: column 8 b + i
    assert torch.equal(widen_bitmask(values, mask), w)
    layer = BitmaskSparseLinear.from_dense(w, dtype=torch.float32)
    assert torch.equal(layer.dequantized_weight(), w)
    assert layer.weight_bytes() == nnz * 4 + 48 * 8 + 48 * 8
    assert layer.sparsity() == pytest.approx(1 - nnz / (48 * 64))


def test_in_features_not_a_multiple_of_8_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="divisible by 8.*pad.*16"):
        BitmaskSparseLinear.from_dense(torch.zeros(4, 12))


def test_untrusted_tensors_are_checked_on_construction():
    values, mask, offsets = compress_bitmask(_weight())
    bad = mask.clone()
    bad[0, 0] ^= 0b1000_0000 if bad[0, 0] & 0b1000_0000 else 0b1000_0000  # one bit more or fewer in row 0
    with pytest.raises(ValueError, match="row_offsets\\[1\\]"):
        BitmaskSparseLinear(values, bad, offsets)
    shifted = offsets.clone()
    shifted[5] += 1
    with pytest.raises(ValueError, match="row_offsets\\[5\\]"):
        BitmaskSparseLinear(values, mask, shifted)
    with pytest.raises(ValueError, match="one value per set bit"):
        BitmaskSparseLinear(values[:-1], mask, offsets)
    with pytest.raises(ValueError, match="row_offsets has shape"):
        BitmaskSparseLinear(values, mask, offsets[:4])
    with pytest.raises(ValueError, match="uint8"):
        BitmaskSparseLinear(values, mask.to(torch.int16), offsets)
    with pytest.raises(ValueError, match="1-D floating point"):
        BitmaskSparseLinear(values.to(torch.int32), mask, offsets)
    with pytest.raises(ValueError, match="integers"):
        BitmaskSparseLinear(values, mask, offsets.float())
    with pytest.raises(ValueError, match="bias"):
        BitmaskSparseLinear(values, mask, offsets, torch.zeros(5))
    assert BitmaskSparseLinear(values, mask, offsets.int()).row_offsets.dtype == torch.int64


def test_metadata_and_tensors_rebuild_the_same_layer():
    layer = BitmaskSparseLinear.from_dense(_weight(), torch.randn(48))
    meta = layer.metadata()
    assert meta == {"format": "sparse_bitmask", "in_features": 64, "out_features": 48}
    tensors = dict(layer.state_dict())
    assert set(tensors) == {"values", "mask", "row_offsets", "bias"}
    rebuilt = LINEAR_FORMATS["sparse_bitmask"].from_tensors(meta, tensors)
    assert all(torch.equal(t, rebuilt.state_dict()[n]) for n, t in tensors.items())
    with pytest.raises(ValueError, match="declares"):
        BitmaskSparseLinear.from_tensors({**meta, "in_features": 32}, tensors)


def test_a_checkpoint_with_a_bitmask_layer_loads_back_identical(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg, seed=2), torch.bfloat16)
    mlp = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mlp.up_proj.weight.copy_(prune_unstructured(mlp.up_proj.weight.float(), 0.8, g))
    mlp.up_proj = to_bitmask(mlp.up_proj)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    assert meta["layers"] == {
        "model.layers.1.mlp.up_proj": {"format": "sparse_bitmask", "in_features": 64, "out_features": 128}
    }
    loaded = load_model(str(tmp_path), dtype="bfloat16", progress=False)
    up = loaded.model.layers[1].mlp.up_proj
    assert isinstance(up, BitmaskSparseLinear) and up.values.dtype == torch.bfloat16
    for name in ("values", "mask", "row_offsets"):
        assert torch.equal(getattr(up, name), getattr(mlp.up_proj, name))
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=g)
    with torch.inference_mode():
        assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from tests.compress.conftest import dense_logits

    return dense_logits(model, ids)
