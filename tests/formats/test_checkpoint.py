"""Checkpoint and the one loader: the recipe and tokenizer travel in the bundle (never as model attributes), every
format is read back through load_checkpoint, and the public names resolve to them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import leanlm
from leanlm.compress import GPTQConfig, MagnitudeConfig, RTNConfig, compress
from leanlm.formats import (
    Checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_compressed_tensors_checkpoint,
    save_gptq_checkpoint,
)
from leanlm.llm import load_model
from leanlm.loading.errors import ModelLoadError
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


def _model(tokenizer, seed: int = 0):
    cfg = tiny_config(tokenizer.vocab_size)
    return build_model(cfg, tiny_state_dict(cfg, seed), torch.float32)


def test_a_checkpoint_holds_a_model_and_a_tuple_recipe(tokenizer):
    model = _model(tokenizer)
    with pytest.raises(TypeError, match="ModelConfig"):
        Checkpoint(torch.nn.Linear(2, 2), tokenizer)
    with pytest.raises(TypeError, match="tuple"):
        Checkpoint(model, tokenizer, [{"method": "rtn"}])
    with pytest.raises(TypeError, match="method"):
        Checkpoint(model, tokenizer, ({"bits": 8},))
    ckpt = Checkpoint(model, tokenizer, ({"method": "a"},))
    later = ckpt.with_recipe([{"method": "b"}])
    assert ckpt.recipe == ({"method": "a"},) and [s["method"] for s in later.recipe] == ["a", "b"]
    assert later.model is model and later.config is model.config


def test_the_recipe_round_trips_through_the_native_format(tokenizer, tmp_path):
    model = _model(tokenizer)
    report = compress(model, [RTNConfig(bits=8)], progress=False)
    assert not hasattr(model, "compression_recipe") and report.recipe == [
        {"method": "rtn", **{k: v for k, v in report.recipe[0].items() if k != "method"}}
    ]
    save_checkpoint(Checkpoint(model, tokenizer, ({"method": "earlier"},)).with_recipe(report.recipe), tmp_path)
    loaded = load_checkpoint(tmp_path, progress=False)
    assert [s["method"] for s in loaded.recipe] == ["earlier", "rtn"] and loaded.recipe[1]["bits"] == 8
    assert loaded.source == tmp_path and loaded.tokenizer.encode(" he said") == tokenizer.encode(" he said")
    assert not hasattr(loaded.model, "tokenizer")  # the tokenizer is in the Checkpoint, not on the network
    assert {n for n, m in loaded.model.named_modules() if isinstance(m, RuntimeLinear)} == {
        n for n, m in model.named_modules() if isinstance(m, RuntimeLinear)
    }


def test_every_format_loads_through_the_one_loader_by_its_metadata(tokenizer, tmp_path):
    """Each format written, its directory renamed to another format's name: the loader goes by what it holds."""
    calib = torch.randint(0, tokenizer.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    gptq = _model(tokenizer)
    compress(gptq, GPTQConfig(bits=4, group_size=32, symmetric=True), calib, progress=False)
    pruned = _model(tokenizer)
    compress(pruned, MagnitudeConfig(pattern="2:4"), progress=False)
    written = {
        "native": save_checkpoint(Checkpoint(gptq, tokenizer), tmp_path / "a", dtype=torch.float32),
        "gptq": save_gptq_checkpoint(Checkpoint(gptq, tokenizer), tmp_path / "b"),
        "compressed-tensors": save_compressed_tensors_checkpoint(Checkpoint(pruned, tokenizer), tmp_path / "c"),
    }
    ids = torch.tensor([[1, 2, 3, 4]])
    for kind, path in written.items():
        renamed = shutil.move(path, tmp_path / f"model.gguf-{kind}")
        ckpt = load_checkpoint(renamed, progress=False)
        assert ckpt.recipe == () and ckpt.tokenizer is not None, kind  # written without steps: none read back
        assert torch.isfinite(_logits(ckpt.model, ids)).all(), kind


def _logits(model, ids):
    from tests.compress.conftest import dense_logits

    return dense_logits(model, ids)


def test_a_checkpoint_the_network_cannot_take_is_a_model_load_error(tokenizer, tmp_path):
    save_checkpoint(Checkpoint(_model(tokenizer), tokenizer), tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(ModelLoadError, match="re-export or re-download"):
        load_checkpoint(tmp_path, progress=False)


def test_the_loader_adapts_the_stored_layers_before_building(tokenizer, tmp_path):
    import dataclasses

    save_checkpoint(Checkpoint(_model(tokenizer), tokenizer), tmp_path, dtype=torch.float32)
    seen = []

    def adapt(stored):
        seen.append(sorted(stored.state_dict)[:1])
        zeroed = {k: torch.zeros_like(v) if k.endswith("down_proj.weight") else v for k, v in stored.state_dict.items()}
        return dataclasses.replace(stored, state_dict=zeroed)

    ckpt = load_checkpoint(tmp_path, progress=False, adapt=adapt)
    assert seen and not ckpt.model.model.layers[0].mlp.down_proj.weight.any()


def test_the_public_names(tokenizer, tmp_path):
    assert leanlm.load_checkpoint is load_checkpoint and leanlm.save_checkpoint is save_checkpoint
    assert leanlm.Checkpoint is Checkpoint
    save_checkpoint(Checkpoint(_model(tokenizer), tokenizer), tmp_path, dtype=torch.float32)
    model = load_model(str(tmp_path), progress=False)
    assert model.config.num_hidden_layers == tiny_config(tokenizer.vocab_size).num_hidden_layers
    assert not hasattr(model, "tokenizer")
