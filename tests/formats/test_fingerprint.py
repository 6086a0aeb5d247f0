"""The checkpoint fingerprint the ranks of a parallel engine compare: equal for the same files wherever they lie,
different when a weight byte in the sampled data, a header or the config changes; read_config needs no tensor."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from leanlm.formats.fingerprint import SAMPLE_BYTES, checkpoint_fingerprint, read_config
from leanlm.formats.loader import load_checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint_dir(tmp_path_factory):
    from leanlm.formats.checkpoint import Checkpoint
    from leanlm.formats.native import save_checkpoint
    from leanlm.model.llama import build_model
    from tests.conftest import tiny_config, tiny_state_dict
    from tests.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = tiny_config(tokenizer.vocab_size)
    model = build_model(config, tiny_state_dict(config), torch.float32)
    return save_checkpoint(Checkpoint(model, tokenizer), tmp_path_factory.mktemp("fp") / "ckpt", dtype=torch.float32)


@pytest.fixture()
def two_copies(tiny_checkpoint_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_checkpoint_dir, a)
    shutil.copytree(tiny_checkpoint_dir, b)
    return a, b


def _flip_data_byte(directory, offset_in_data: int) -> None:
    path = next(directory.glob("*.safetensors"))
    with open(path, "r+b") as f:
        (header,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header + offset_in_data)
        byte = f.read(1)
        f.seek(8 + header + offset_in_data)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_copies_agree_and_a_changed_weight_byte_or_config_does_not(two_copies):
    a, b = two_copies
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    assert SAMPLE_BYTES >= 1 << 20
    _flip_data_byte(b, 10)  # inside the first MiB of data every rank samples
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)
    raw = json.loads((a / "config.json").read_text())
    raw["rms_norm_eps"] = raw.get("rms_norm_eps", 1e-5) * 2
    before = checkpoint_fingerprint(a)
    (a / "config.json").write_text(json.dumps(raw))
    assert checkpoint_fingerprint(a) != before


def test_read_config_is_the_loaders_config(tiny_checkpoint_dir):
    assert read_config(tiny_checkpoint_dir) == load_checkpoint(tiny_checkpoint_dir, progress=False).config
