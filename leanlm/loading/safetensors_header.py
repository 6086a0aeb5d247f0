"""A bounded check of a safetensors header (8-byte length + JSON), run before the safetensors library maps it.

The format: a little-endian u64 N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, optional
"__metadata__": {str: str}}, then the byte buffer, which the tensors must index entirely and without overlap.
We read at most N bytes, and only after checking that N fits in the file.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from leanlm.loading.errors import ModelLoadError

# The safetensors library's own ceiling on the JSON header; real headers are well under 1 MB.
MAX_HEADER_BYTES = 100 << 20
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class _Invalid(Exception):
    pass


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(name: str, entry, buffer_bytes: int) -> tuple[int, int]:
    """(begin, end) of one tensor, after checking its dtype and shape account exactly for those bytes."""
    if not isinstance(entry, dict):
        raise _Invalid(f"entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise _Invalid(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _Invalid(f"tensor {name!r} shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise _Invalid(f"tensor {name!r} data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not begin <= end <= buffer_bytes:
        raise _Invalid(f"tensor {name!r} data_offsets [{begin}, {end}] lie outside the {buffer_bytes}-byte data buffer")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]  # Python ints: a huge shape cannot overflow
    if end - begin != expected:
        raise _Invalid(
            f"tensor {name!r} is {dtype} {shape} ({expected} bytes) but data_offsets span {end - begin} bytes"
        )
    return begin, end


def check_safetensors_header(path: str | Path) -> dict[str, dict]:
    """The tensor entries of the safetensors file at `path`; ModelLoadError when the header is inconsistent."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_bytes = f.seek(0, 2)
            f.seek(0)
            if file_bytes < 8:
                raise _Invalid(f"the file is {file_bytes} bytes, shorter than the 8-byte header length")
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            if header_bytes > min(file_bytes - 8, MAX_HEADER_BYTES):
                raise _Invalid(
                    f"the header length {header_bytes} exceeds the {file_bytes - 8} bytes that follow "
                    f"(or the {MAX_HEADER_BYTES}-byte limit)"
                )
            raw = f.read(header_bytes)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise _Invalid(f"the header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise _Invalid("the header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise _Invalid("__metadata__ is not an object of strings")
        buffer_bytes = file_bytes - 8 - header_bytes
        spans = sorted((_check_entry(name, entry, buffer_bytes), name) for name, entry in header.items())
        # The buffer must be indexed entirely, without holes or overlaps (the format's own rule).
        covered = 0
        for (begin, end), name in spans:
            if begin != covered:
                problem = "overlaps the tensor before it" if begin < covered else f"leaves a hole at byte {covered}"
                raise _Invalid(f"tensor {name!r} at data_offsets [{begin}, {end}] {problem}")
            covered = end
        if covered != buffer_bytes:
            raise _Invalid(f"the tensors index {covered} of the {buffer_bytes} data bytes (truncated or padded)")
        return header
    except _Invalid as e:
        raise ModelLoadError(f"safetensors file {path} is corrupt or truncated ({e}); re-download it") from None
    except RecursionError:
        raise ModelLoadError(
            f"safetensors file {path} is corrupt or truncated (its JSON header nests too deeply); re-download it"
        ) from None
