"""inspect(path) tells a GGUF file, an HF directory and the two quantized directory kinds apart by contents."""

from __future__ import annotations

import shutil

import pytest
import torch

from leanlm.compress import RTNConfig, compress
from leanlm.formats import save_checkpoint, save_gptq_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.inspect import ModelFormat, inspect
from leanlm.loading.errors import ModelLoadError
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


def _model():
    config = tiny_config(128)
    return build_model(config, tiny_state_dict(config), torch.float32)


def test_each_kind_is_told_by_its_contents(tiny_gguf, tmp_path):
    gguf, _ = tiny_gguf("llama")
    renamed = tmp_path / "model.bin"  # the GGUF magic decides, not the name
    shutil.copy(gguf, renamed)
    assert inspect(renamed).format is ModelFormat.GGUF and not inspect(renamed).is_directory
    save_checkpoint(Checkpoint(_model(), None), tmp_path / "float", dtype=torch.float32)
    assert inspect(tmp_path / "float").format is ModelFormat.LEANLM_CHECKPOINT  # no layer quantized, still ours
    shutil.copytree(tmp_path / "float", tmp_path / "hf")
    (tmp_path / "hf" / "quantization_config.json").unlink()  # config.json + safetensors: a plain HF directory
    assert inspect(tmp_path / "hf").format is ModelFormat.HF_DIR
    quantized = _model()
    compress(quantized, RTNConfig(bits=4, group_size=32), progress=False)
    save_checkpoint(Checkpoint(quantized, None), tmp_path / "rtn")
    assert inspect(tmp_path / "rtn").format is ModelFormat.LEANLM_CHECKPOINT
    save_gptq_checkpoint(Checkpoint(quantized, None), tmp_path / "gptq")
    source = inspect(tmp_path / "gptq")
    assert source.format is ModelFormat.GPTQ and source.is_directory and source.path == tmp_path / "gptq"


def test_anything_else_is_refused_with_what_to_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        inspect(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        inspect(tmp_path / "notes.txt")
