"""read_checkpoint: resolves names, dispatches on what a path *is* (never on its extension)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from leanlm.formats.gguf import load_gguf
from leanlm.formats.hf_dir import save_hf_dir
from leanlm.formats.stored import StoredCheckpoint, read_checkpoint
from leanlm.loading.errors import ModelLoadError


def test_default_model(smollm, smollm_dir):
    assert isinstance(smollm, StoredCheckpoint)
    assert smollm.source == smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm.config.architecture == "llama" and len(smollm.state_dict) == 272
    assert smollm.tokenizer.eos_token_ids == smollm.config.eos_token_ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        smollm.config = None  # type: ignore[misc]


def test_gguf_with_any_file_name(tiny_gguf, tmp_path):
    path, expected = tiny_gguf("llama", False)
    renamed = tmp_path / "weights.safetensors"  # a misleading extension must not matter
    shutil.copy(path, renamed)
    ckpt = read_checkpoint(renamed, progress=False)
    assert ckpt.config.architecture == "llama" and set(ckpt.state_dict) == set(expected)
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode(" he said")) == " he said"
    tokens = ckpt.tokenizer.convert_ids_to_tokens(ckpt.tokenizer.eos_token_ids)
    assert tokens == ["<|im_end|>", "<|endoftext|>"]


def test_hf_dir_with_gguf_like_name(smollm, tiny_gguf, tmp_path):
    config, state_dict, _ = load_gguf(tiny_gguf("llama", True)[0], progress=False)
    model_dir = tmp_path / "model.gguf"  # a directory, despite the name
    save_hf_dir(model_dir, config, state_dict)
    smollm.tokenizer.save(model_dir)
    ckpt = read_checkpoint(model_dir, progress=False)
    assert ckpt.config == dataclasses.replace(config, name="") and ckpt.source == model_dir


def test_hf_dir_without_tokenizer(tiny_gguf, tmp_path):
    config, state_dict, _ = load_gguf(tiny_gguf("qwen2", True)[0], progress=False)
    save_hf_dir(tmp_path, config, state_dict)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        read_checkpoint(tmp_path, progress=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        read_checkpoint(tmp_path)


def test_file_that_is_neither(tmp_path):
    junk = tmp_path / "model.gguf"
    junk.write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        read_checkpoint(junk)


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="bundled models: smollm2-135m-instruct"):
        read_checkpoint("definitely-not-a-model")
