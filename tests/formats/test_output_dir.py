"""Writing a model directory: another model's directory or the source is never overwritten, a non-empty one is
replaced only with overwrite=True, and the files are staged beside it and renamed into place."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.compress import MagnitudeConfig, RTNConfig, compress
from leanlm.formats import (
    Checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_compressed_tensors_checkpoint,
    save_gptq_checkpoint,
)
from leanlm.formats import native as native_format
from leanlm.formats.output_dir import OutputDirError, check_output_dir, staged_output_dir
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


def _checkpoint(tokenizer, seed: int = 0) -> Checkpoint:
    cfg = tiny_config(tokenizer.vocab_size)
    return Checkpoint(build_model(cfg, tiny_state_dict(cfg, seed), torch.float32), tokenizer)


def _other_model_dir(path):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "someone else"}')
    return path


def test_a_non_empty_directory_is_refused_without_overwrite(tokenizer, tmp_path):
    other = _other_model_dir(tmp_path / "other")
    with pytest.raises(OutputDirError, match=r"not empty \(it holds config.json\).*--overwrite"):
        save_checkpoint(_checkpoint(tokenizer), other)
    assert (other / "config.json").read_text() == '{"model_type": "someone else"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]  # no staging directory left behind


@pytest.mark.parametrize(
    "save, recipe",
    [
        (save_gptq_checkpoint, RTNConfig(bits=4, group_size=32, symmetric=True)),
        (save_compressed_tensors_checkpoint, MagnitudeConfig(pattern="2:4")),
    ],
)
def test_every_writer_refuses_a_non_empty_directory(save, recipe, tokenizer, tmp_path):
    ckpt = _checkpoint(tokenizer)
    compress(ckpt.model, [recipe], progress=False)
    other = _other_model_dir(tmp_path / "other")
    with pytest.raises(OutputDirError, match="not empty"):
        save(ckpt, other)
    assert json.loads((other / "config.json").read_text()) == {"model_type": "someone else"}
    save(ckpt, other, overwrite=True)
    assert load_checkpoint(str(other), progress=False).config.vocab_size == tokenizer.vocab_size


def test_overwrite_replaces_the_whole_directory(tokenizer, tmp_path):
    other = _other_model_dir(tmp_path / "other")
    (other / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    save_checkpoint(_checkpoint(tokenizer, seed=3), other, dtype=torch.float32, overwrite=True)
    assert not (other / "model-00001-of-00002.safetensors").exists()  # nothing of the old model is mixed in
    assert json.loads((other / "config.json").read_text())["model_type"] != "someone else"
    loaded = load_checkpoint(str(other), progress=False)
    expected = _checkpoint(tokenizer, seed=3).model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.model.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_a_new_or_empty_directory_is_written(tokenizer, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "nested"):
        assert save_checkpoint(_checkpoint(tokenizer), out) == out
        assert load_checkpoint(str(out), progress=False).config.vocab_size == tokenizer.vocab_size


def test_the_source_is_never_the_output_even_with_overwrite(tokenizer, tmp_path):
    source = save_checkpoint(_checkpoint(tokenizer), tmp_path / "model" / "src")
    ckpt = load_checkpoint(str(source), progress=False)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    for out, where in [(source, "is"), (source / "sub", "is inside"), (tmp_path / "model", "holds")]:
        with pytest.raises(OutputDirError, match=f"{where} .* which this run reads"):
            save_checkpoint(ckpt, out, overwrite=True)
    # the same directory named another way (a relative path through a symlink) is still the source
    (tmp_path / "link").symlink_to(source)
    with pytest.raises(OutputDirError, match="which this run reads"):
        save_checkpoint(ckpt, tmp_path / "link", overwrite=True)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before


def test_a_failed_save_leaves_the_old_directory_and_no_partial_one(tokenizer, tmp_path, monkeypatch):
    out = save_checkpoint(_checkpoint(tokenizer, seed=1), tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def write_then_fail(checkpoint, path, state, head_is_quantized):
        (path / "config.json").write_text("{}")  # half a model written...
        raise OSError(28, "No space left on device")  # ...then the disk fills

    monkeypatch.setattr(native_format, "write_model_dir", write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(_checkpoint(tokenizer, seed=2), out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_kept_entries_move_into_the_new_directory(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "state.pt").write_bytes(b"state")
    (out / "cache").mkdir()
    (out / "cache" / "0.bin").write_bytes(b"window")
    # only its own entries: not "non-empty" for a writer that keeps them
    with staged_output_dir(out, keep_files=("state.pt", "cache")) as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["cache", "config.json", "state.pt"]
    assert (out / "cache" / "0.bin").read_bytes() == b"window" and (out / "state.pt").read_bytes() == b"state"
    (out / "stray.txt").write_text("x")
    with pytest.raises(OutputDirError, match="stray.txt"):
        check_output_dir(out, own_files=("state.pt", "cache", "config.json"))


def test_a_file_is_not_an_output_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        check_output_dir(tmp_path / "f", overwrite=True)


def test_overwrite_never_replaces_the_working_directory_or_above_it(tmp_path, monkeypatch):
    work = tmp_path / "project" / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", "..", tmp_path):
        with pytest.raises(OutputDirError, match="replacing it would delete that"):
            check_output_dir(out, overwrite=True)
    assert check_output_dir(tmp_path / "elsewhere", overwrite=True) == (tmp_path / "elsewhere").resolve()
