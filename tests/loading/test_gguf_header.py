"""Hostile GGUF files: truncations, bit flips and absurd counts must end in a ModelLoadError, fast and small.

The field positions are found with the `gguf` package's own reader on the intact file (an oracle independent
of our scan); the mutations come from a seeded RNG, so every run tests the same files.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from leanlm.formats.stored import read_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_header import scan_gguf_header
from tests.loading.conftest import bounded

ABSURD = (2**64 - 1, 2**63, 2**62, 2**40, 2**31)
REAL_HEADER_BYTES = 2 << 20  # SmolLM2's header (tokenizer included) ends at 1.7 MB


def _load(path) -> bool:
    """True when the file loads (a harmless mutation); a ModelLoadError is the only other allowed outcome."""
    with bounded():
        try:
            read_checkpoint(path, progress=False)
        except ModelLoadError:
            return False
    return True


def _fails(path, seconds: float = 2.0) -> None:
    with bounded(seconds):
        with pytest.raises(ModelLoadError):
            read_checkpoint(path, progress=False)


def _length_fields(path) -> list[tuple[int, str]]:
    """(byte offset, format) of every count, length, dimension and offset in the header, via GGUFReader."""
    reader = GGUFReader(path)
    base = reader.data.ctypes.data

    def at(part: np.ndarray) -> int:
        return part.ctypes.data - base

    fields = [(8, "Q"), (16, "Q")]  # tensor count, key/value count
    for field in list(reader.fields.values())[3:]:  # the first three are the preamble's pseudo-fields
        parts = field.parts
        fields.append((at(parts[0]), "Q"))  # key length
        if field.types[0] == GGUFValueType.STRING:
            fields.append((at(parts[3]), "Q"))
        elif field.types[0] == GGUFValueType.ARRAY:
            fields.append((at(parts[4]), "Q"))  # array length
            if field.types[1] == GGUFValueType.STRING:
                fields += [(at(parts[i]), "Q") for i in (5, len(parts) - 2)]  # first and last string length
    for tensor in reader.tensors[:3] + reader.tensors[-2:]:
        name_len, _, n_dims, dims, _, offset = tensor.field.parts
        fields += [(at(name_len), "Q"), (at(n_dims), "I"), (at(dims), "Q"), (at(offset), "Q")]
    return fields


def _the_49_byte_file() -> bytes:
    """A 49-byte file declaring a 2^62-element uint8 array: the `gguf` reader loops on it for ever."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 2**62)
    assert len(data) == 49
    return data


@pytest.fixture
def write(tmp_path):
    counter = iter(range(10**9))

    def write(data: bytes):
        path = tmp_path / f"case{next(counter)}.gguf"
        path.write_bytes(data)
        return path

    return write


def test_49_byte_file_declaring_a_huge_array(write):
    path = write(_the_49_byte_file())
    with bounded(seconds=1.0):
        with pytest.raises(ModelLoadError, match="array length is 4611686018427387904, more than the 0 bytes"):
            read_checkpoint(path)


def test_valid_files_pass_the_scan(tiny_gguf, smollm_dir):
    path, _ = tiny_gguf("llama", True)
    header = scan_gguf_header(path)
    assert header.version == 3 and header.num_tensors == 2 * 9 + 2 and header.data_offset % 32 == 0
    real = scan_gguf_header(smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (real.num_tensors, real.num_kv, real.file_bytes) == (272, 33, 98_362_432)


def test_truncations(tiny_gguf, write):
    data = tiny_gguf("llama", True)[0].read_bytes()
    rng = np.random.default_rng(14)
    # Every cut shorter than the file minus one alignment unit removes header or tensor bytes.
    cuts = list(range(0, 64)) + sorted(rng.integers(64, len(data) - 32, size=40).tolist())
    for cut in cuts:
        _fails(write(data[:cut]))


@pytest.mark.parametrize("value", ABSURD)
def test_absurd_counts_and_lengths(tiny_gguf, write, value):
    path, _ = tiny_gguf("llama", True)
    data = path.read_bytes()
    fields = _length_fields(path)
    assert len(fields) > 40
    for offset, fmt in fields:
        if fmt == "I" and value >= 2**32:
            continue
        mutated = bytearray(data)
        struct.pack_into("<" + fmt, mutated, offset, value)
        _fails(write(bytes(mutated)))


def test_bit_flips_in_the_header(tiny_gguf, write):
    path, _ = tiny_gguf("qwen2", False)
    data = path.read_bytes()
    header_bytes = scan_gguf_header(path).data_offset
    rng = np.random.default_rng(2026)
    outcomes = []
    for _ in range(200):
        mutated = bytearray(data)
        for pos in rng.integers(0, header_bytes, size=int(rng.integers(1, 4))):
            mutated[pos] ^= 1 << int(rng.integers(0, 8))
        outcomes.append(_load(write(bytes(mutated))))
    # A flip inside a token's text or a float can leave a loadable file; most flips must be caught.
    assert outcomes.count(False) >= 100, outcomes.count(False)


def test_mutations_of_the_real_header(smollm_dir, write):
    with open(smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf", "rb") as f:
        prefix = f.read(REAL_HEADER_BYTES)  # the tensor data is cut: every case must fail
    rng = np.random.default_rng(135)
    cases = [prefix, prefix[:100_000], prefix[:1_000_001]]
    for _ in range(6):
        mutated = bytearray(prefix)
        mutated[int(rng.integers(0, 1_700_000))] ^= 0xFF
        cases.append(bytes(mutated))
    for value in ABSURD[:2]:
        mutated = bytearray(prefix)
        struct.pack_into("<Q", mutated, 16, value)  # the key/value count
        cases.append(bytes(mutated))
    # a hang guard, not a speed test: under tracemalloc each 1.7 MB real header (its 49k-token vocabulary and merges)
    # takes about 1 s to parse on a 2-core Zen 3, so 2 s failed whenever the machine was busy
    for case in cases:
        _fails(write(case), seconds=10.0)
