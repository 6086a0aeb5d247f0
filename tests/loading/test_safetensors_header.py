"""Hostile safetensors files: absurd header lengths, bad JSON, offsets out of range or overlapping, dtype/shape
that disagree with the byte range, truncations and bit flips; each ends in a ModelLoadError, fast and small."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from leanlm.formats.hf_dir import load_hf_dir, save_hf_dir
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.safetensors_header import check_safetensors_header
from tests.formats.test_hf_dir import random_state_dict, tiny_config
from tests.loading.conftest import bounded


@pytest.fixture
def model_dir(tmp_path):
    config = tiny_config("llama", tied=True, vocab_size=64)
    save_hf_dir(tmp_path, config, random_state_dict(config))
    return tmp_path


def _split(path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, buffer: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + buffer


def _fails(model_dir, data: bytes, match: str = "corrupt or truncated") -> None:
    (model_dir / "model.safetensors").write_bytes(data)
    with bounded():
        with pytest.raises(ModelLoadError, match=match):
            load_hf_dir(model_dir, progress=False)


def test_intact_file_passes(model_dir):
    header = check_safetensors_header(model_dir / "model.safetensors")
    assert "model.norm.weight" in header and "__metadata__" not in header
    load_hf_dir(model_dir, progress=False)


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, 2**40, 10**9])
def test_absurd_header_length(model_dir, length):
    data = (model_dir / "model.safetensors").read_bytes()
    _fails(model_dir, struct.pack("<Q", length) + data[8:], match=f"header length {length} exceeds")


@pytest.mark.parametrize("junk", [b"{", b"[1, 2]", b"\xff\xfe{}", b"{" * 100_000, b'{"a": 1}'])
def test_bad_json(model_dir, junk):
    _fails(model_dir, struct.pack("<Q", len(junk)) + junk)


def _edit(model_dir, change) -> bytes:
    header, buffer = _split(model_dir / "model.safetensors")
    entry = header["model.layers.0.self_attn.q_proj.weight"]
    change(header, entry)
    return _join(header, buffer)


CASES = {
    "offsets beyond the buffer": (lambda h, e: e.update(data_offsets=[e["data_offsets"][0], 2**62]), "outside"),
    "reversed offsets": (lambda h, e: e.update(data_offsets=e["data_offsets"][::-1]), "outside"),
    "negative offset": (lambda h, e: e.update(data_offsets=[-8, e["data_offsets"][1]]), r"not \[begin, end\]"),
    "overlap": (
        lambda h, e: h["model.norm.weight"].update(
            data_offsets=e["data_offsets"][:1] + [e["data_offsets"][0] + 4 * h["model.norm.weight"]["shape"][0]]
        ),
        "overlaps|hole",
    ),
    "shape larger than range": (lambda h, e: e.update(shape=[e["shape"][0] * 2, e["shape"][1]]), "span"),
    "absurd shape": (lambda h, e: e.update(shape=[2**62, 2**62]), "span"),
    "dtype narrower than range": (lambda h, e: e.update(dtype="F16"), "span"),
    "unknown dtype": (lambda h, e: e.update(dtype="F33"), "unknown dtype"),
    "shape not a list": (lambda h, e: e.update(shape="32x32"), "shape"),
    "metadata not strings": (lambda h, e: h.update(__metadata__={"format": 1}), "__metadata__"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inconsistent_entries(model_dir, case):
    change, match = CASES[case]
    _fails(model_dir, _edit(model_dir, change), match=match)


def test_truncations_and_bit_flips(model_dir):
    data = (model_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    rng = np.random.default_rng(8)
    for cut in list(range(0, 16)) + sorted(rng.integers(16, len(data) - 1, size=30).tolist()):
        _fails(model_dir, data[:cut])
    caught = 0
    for _ in range(150):
        mutated = bytearray(data)
        pos = int(rng.integers(0, 8 + n))  # the length and the JSON: flips in the data are just other weights
        mutated[pos] ^= 1 << int(rng.integers(0, 8))
        (model_dir / "model.safetensors").write_bytes(bytes(mutated))
        with bounded():
            try:
                load_hf_dir(model_dir, progress=False)
            except ModelLoadError:
                caught += 1
    # A flip in a digit of an offset, a dtype or a name is caught; one in padding spaces may be harmless.
    assert caught >= 100, caught
