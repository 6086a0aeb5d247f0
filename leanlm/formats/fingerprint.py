"""What every rank of a parallel engine can compute of a checkpoint without reading all its weights, to check that
all ranks loaded the same one: its metadata files, each weight file's header (names, dtypes, shapes, offsets) and
size, and a sample of its data (the first and last bytes of the weights)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from leanlm.config import ModelConfig
from leanlm.formats.gguf import gguf_model_config, open_gguf
from leanlm.formats.hf_dir import shard_files
from leanlm.formats.hf_slice import read_hf_dir_config
from leanlm.formats.inspect import ModelFormat, inspect
from leanlm.loading.gguf_header import scan_gguf_header

SAMPLE_BYTES = 1 << 20  # of data read at each end of each weight file
_MAX_METADATA_BYTES = 64 << 20  # a config or tokenizer file larger than this is hashed by its first bytes


def read_config(name_or_path: str | Path) -> ModelConfig:
    """Only the ModelConfig of a model (GGUF metadata, or config.json bounded by the layers the headers list): what a
    rank plans its slice from before it reads a tensor."""
    source = inspect(name_or_path)
    if source.format is ModelFormat.GGUF:
        return gguf_model_config(open_gguf(source.path))
    return read_hf_dir_config(source.path)


def checkpoint_fingerprint(name_or_path: str | Path) -> str:
    """BLAKE2b over the checkpoint's metadata files, each weight file's name, size and header, and SAMPLE_BYTES of
    its data at each end: equal on every rank that reads the same files, whatever slice of them it keeps."""
    source = inspect(name_or_path)
    digest = hashlib.blake2b(digest_size=16)
    if source.format is ModelFormat.GGUF:
        weights = [(source.path, scan_gguf_header(source.path).data_offset)]
    else:
        for meta in sorted(p for p in source.path.iterdir() if p.suffix == ".json" and p.is_file()):
            _update(digest, meta, 0, min(meta.stat().st_size, _MAX_METADATA_BYTES), 0)
        weights = [(f, 8 + _safetensors_header_bytes(f)) for f in shard_files(source.path)]
    for path, data_start in weights:
        size = path.stat().st_size
        _update(digest, path, data_start + SAMPLE_BYTES, SAMPLE_BYTES, size)
    return digest.hexdigest()


def _update(digest, path: Path, head_bytes: int, tail_bytes: int, size: int) -> None:
    """The file's name, size, first `head_bytes` and last `tail_bytes` (positioned reads: the page cache, not this
    process's memory)."""
    size = size or path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        digest.update(f.read(min(head_bytes, size)))
        f.seek(max(0, size - tail_bytes))
        digest.update(f.read(tail_bytes))


def _safetensors_header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]
