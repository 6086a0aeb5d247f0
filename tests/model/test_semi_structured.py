"""Sparse24Linear, the 2:4 runtime format: exact compress / widen round trips, the errors for weights that are not
2:4 and for untrusted tensors, every kernel disabled (F.linear on the dense weight), and a checkpoint saved and
loaded back. The forward paths it shares with BitmaskSparseLinear are tested in test_widened.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.llm import load_model
from leanlm.model.linear import tensor_cores
from leanlm.model.linear.base import LINEAR_FORMATS
from leanlm.model.linear.sparse24 import Sparse24Linear, compress_24, mask_bits, to_sparse24, widen_24
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict
from tests.kernels.test_cpu_sparse import prune_24

GEN_SEED = 0


def _weight(n: int = 48, k: int = 64, seed: int = GEN_SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return prune_24(torch.randn(n, k, generator=g) / k**0.5, g)


def test_compress_and_widen_round_trip_exactly():
    w = _weight()
    w[0, :8] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0])  # an empty group, one with its last column
    values, mask = compress_24(w, torch.float32)
    assert values.shape == (48, 32) and mask.shape == (48, 8) and mask.dtype == torch.uint8
    assert torch.equal(widen_24(values, mask), w)
    bits = mask_bits(mask).view(48, 16, 4)
    assert (bits.sum(-1) == 2).all()  # every group stores exactly two values
    assert bits[0, 0].tolist() == [True, True, False, False]  # an empty group keeps its first two columns
    assert bits[0, 1].tolist() == [True, False, False, True] and values[0, 2:4].tolist() == [0.0, 3.0]
    assert mask[0, 0] == 0b1001_0011  # group 0 in the low nibble, group 1 in the high one
    layer = Sparse24Linear.from_dense(w, dtype=torch.float32)
    assert torch.equal(layer.dequantized_weight(), w) and layer.weight_bytes() == 48 * (32 * 4 + 8)


def test_weights_that_are_not_2_4_are_refused_with_their_place():
    w = _weight()
    w[5, 8:12] = torch.tensor([1.0, 2.0, 3.0, 0.0])
    with pytest.raises(ValueError, match="row 5, input columns 8-11 hold 3 nonzeros.*prune"):
        Sparse24Linear.from_dense(w)
    with pytest.raises(ValueError, match="divisible by 8.*pad"):
        Sparse24Linear.from_dense(torch.zeros(4, 12))


def test_untrusted_tensors_are_checked_on_construction():
    values, mask = compress_24(_weight())
    bad = mask.clone()
    bad[3, 2] = 0b0111_0011  # a nibble with 3 bits: the kernel would read a value past the group
    with pytest.raises(ValueError, match="3 columns in row 3, group 5"):
        Sparse24Linear(values, bad)
    bad[3, 2] = 0b0011_0001
    with pytest.raises(ValueError, match="1 columns in row 3, group 4"):
        Sparse24Linear(values, bad)
    with pytest.raises(ValueError, match="mask has shape"):
        Sparse24Linear(values, mask[:, :4])
    with pytest.raises(ValueError, match="uint8"):
        Sparse24Linear(values, mask.to(torch.int16))
    with pytest.raises(ValueError, match="floating point"):
        Sparse24Linear(values.to(torch.int32), mask)
    with pytest.raises(ValueError, match="multiple of 8"):
        Sparse24Linear(values[:, :6], mask[:, :1])
    with pytest.raises(ValueError, match="bias"):
        Sparse24Linear(values, mask, torch.zeros(5))


def test_metadata_and_tensors_rebuild_the_same_layer():
    layer = Sparse24Linear.from_dense(_weight(), torch.randn(48))
    meta = layer.metadata()
    assert meta == {"format": "sparse24", "in_features": 64, "out_features": 48}
    tensors = dict(layer.state_dict())
    rebuilt = LINEAR_FORMATS["sparse24"].from_tensors(meta, tensors)
    assert all(torch.equal(t, rebuilt.state_dict()[n]) for n, t in tensors.items())
    with pytest.raises(ValueError, match="declares"):
        Sparse24Linear.from_tensors({**meta, "in_features": 32}, tensors)


_NO_KERNELS = textwrap.dedent("""
    import torch
    from leanlm.kernels import cpu_gemm, cpu_gemv, cpu_sparse
    from leanlm.model.linear.sparse24 import Sparse24Linear
    from tests.kernels.test_cpu_sparse import prune_24
    assert not (cpu_sparse.is_available() or cpu_gemv.is_available() or cpu_gemm.is_available())
    g = torch.Generator().manual_seed(0)
    w, b = prune_24(torch.randn(24, 64, generator=g), g).bfloat16(), torch.randn(24, generator=g).bfloat16()
    layer = Sparse24Linear.from_dense(w, b)
    for rows in (1, 12):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(layer(x), torch.nn.functional.linear(x, w, b))
    print("ok")
""")


def test_with_every_kernel_disabled_it_runs_f_linear_on_the_dense_weight():
    env = dict(os.environ, LEANLM_DISABLE_KERNELS="1")
    root = Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", _NO_KERNELS], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_sparse_tensor_cores_take_only_cuda_rows_of_shapes_they_support():
    """The GPU path itself runs in tests/model/test_formats_cuda.py; here, that nothing else reaches it."""
    values = torch.zeros(64, 128, dtype=torch.bfloat16)  # a 256-wide weight
    x = torch.zeros(1, 256, dtype=torch.bfloat16).expand(tensor_cores.MIN_MACS // (64 * 256), 256)  # enough MACs
    assert not tensor_cores.should_use(x, values)  # CPU tensors
    assert tensor_cores.fits(values)
    assert not tensor_cores.fits(values.float())  # float32: no sparse tensor cores
    assert not tensor_cores.fits(values[:48])  # rows not a multiple of 32
    assert not tensor_cores.fits(values[:, :80])  # in_features 160: not a multiple of 64
    layer = Sparse24Linear(values, torch.full((64, 32), 0b0011_0011, dtype=torch.uint8))
    assert layer.tensor_core_weight(x) is None and layer.semi_structured.value is None


def test_a_checkpoint_with_a_2_4_layer_loads_back_identical(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg, seed=2), torch.bfloat16)
    mlp = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mlp.up_proj.weight.copy_(prune_24(mlp.up_proj.weight.float(), g))
    mlp.up_proj = to_sparse24(mlp.up_proj)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    assert meta["layers"] == {
        "model.layers.1.mlp.up_proj": {"format": "sparse24", "in_features": 64, "out_features": 128}
    }
    loaded = load_model(str(tmp_path), dtype="bfloat16", progress=False)
    up = loaded.model.layers[1].mlp.up_proj
    assert isinstance(up, Sparse24Linear) and up.values.dtype == torch.bfloat16
    assert torch.equal(up.values, mlp.up_proj.values) and torch.equal(up.mask, mlp.up_proj.mask)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=g)
    with torch.inference_mode():
        assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from tests.compress.conftest import dense_logits

    return dense_logits(model, ids)
