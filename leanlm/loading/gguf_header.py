"""A bounded read of a GGUF header (v2/v3): every metadata value and tensor info, checked as it is read.

`gguf.GGUFReader` trusts every declared count: a 49-byte file declaring a 2^62-element array makes it loop
(and grow memory) for ever. Here every count and length is checked against the bytes that remain before it is
used, so a damaged file fails in time and memory proportional to its size, never to what it claims. It is
also ~30x faster than GGUFReader on a vocabulary of 49k tokens and merges (slices of a bytes map, not numpy
memmap views), which is most of a small model's load time; gguf_file.py builds the tensors on it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES

from leanlm.loading.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit counts; the `gguf` reader handles only v2 and v3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Arrays of arrays are legal, but no real file nests more than once; the reader recurses per level.
MAX_ARRAY_DEPTH = 4

# GGUFValueType -> size in bytes of a scalar of that type (8 STRING and 9 ARRAY are variable-length).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALAR_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_UINT32 = 4
# Smallest encodings, used to bound counts by the bytes that remain: a string is its 8-byte length; a
# key/value is a key plus a 4-byte type plus a 1-byte value; a tensor info is name, n_dims, type, offset.
_MIN_STRING = 8
_MIN_VALUE = {**_SCALAR_BYTES, _STRING: _MIN_STRING, _ARRAY: 12}
_MIN_KV = _MIN_STRING + 4 + 1
_MIN_TENSOR_INFO = _MIN_STRING + 4 + 4 + 8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: dims innermost first (as GGUF lists them), ggml type id, byte range in the data."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # relative to GGUFHeader.data_offset
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What the scan established; every tensor's bytes lie within [data_offset, file_bytes)."""

    version: int  # 2 or 3
    byte_order: str  # struct prefix: "<" little-endian (every file we know), ">" big-endian
    num_tensors: int
    num_kv: int
    data_offset: int  # where tensor data starts: end of the tensor infos, rounded up to the alignment
    file_bytes: int
    # key -> value: ints, floats, bools, strs, and lists of them for arrays (file order)
    fields: dict = field(default_factory=dict, repr=False)
    tensors: tuple[TensorInfo, ...] = field(default=(), repr=False)


class _Corrupt(Exception):
    """A header defect at a byte offset (turned into a ModelLoadError naming the file)."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(offset, what)
        self.offset, self.what = offset, what


class _Truncated(Exception):
    def __init__(self, expected: int, found: int) -> None:
        super().__init__(expected, found)
        self.expected, self.found = expected, found


class _Cursor:
    """Reads typed values from a buffer; each read first checks that the bytes are there."""

    def __init__(self, buf, order: str) -> None:
        self.buf, self.order, self.pos, self.size = buf, order, 0, len(buf)

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.remaining:
            raise _Corrupt(self.pos, f"{what} needs {n} bytes but only {self.remaining} remain")

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def unpack(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def count(self, what: str, min_item_bytes: int) -> int:
        """A u64 count whose items (each at least `min_item_bytes`) must fit in the bytes that remain."""
        start = self.pos
        n = self.unpack("Q", what)
        if n * min_item_bytes > self.remaining:
            raise _Corrupt(start, f"{what} is {n}, more than the {self.remaining} bytes that remain can hold")
        return n

    def string(self, what: str) -> bytes:
        start = self.pos
        n = self.count(f"{what} length", 1)
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(start, f"{what} is not valid UTF-8") from None
        return data

    def strings(self, n: int, what: str) -> list[str]:
        """n strings, checked as string() checks one; a tight loop (a vocabulary is ~100k of them)."""
        buf, pos, size = self.buf, self.pos, self.size
        length_at = struct.Struct(self.order + "Q").unpack_from
        out = []
        for _ in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what} length")
            (length,) = length_at(buf, pos)
            if length > size - pos - 8:
                raise _Corrupt(
                    pos, f"{what} length is {length}, more than the {size - pos - 8} bytes that remain can hold"
                )
            try:
                out.append(buf[pos + 8 : pos + 8 + length].decode("utf-8"))
            except UnicodeDecodeError:
                raise _Corrupt(pos, f"{what} is not valid UTF-8") from None
            pos += 8 + length
        self.pos = pos
        return out

    def scalars(self, value_type: int, n: int, what: str) -> list:
        """n scalars of one GGUFValueType (their bytes already checked to fit)."""
        size = _SCALAR_BYTES[value_type]
        self.need(n * size, what)
        values = struct.unpack_from(f"{self.order}{n}{_SCALAR_FORMAT[value_type]}", self.buf, self.pos)
        self.pos += n * size
        return [bool(v) for v in values] if value_type == _BOOL else list(values)


def _read_value(cur: _Cursor, value_type: int, depth: int, what: str):
    if value_type in _SCALAR_BYTES:
        return cur.scalars(value_type, 1, what)[0]
    if value_type == _STRING:
        return cur.string(what).decode("utf-8")
    if value_type == _ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise _Corrupt(cur.pos, f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        start = cur.pos
        item_type = cur.unpack("I", f"{what} item type")
        if item_type not in _MIN_VALUE:
            raise _Corrupt(start, f"{what} has unknown item type {item_type}")
        n = cur.count(f"{what} array length", _MIN_VALUE[item_type])
        if item_type in _SCALAR_BYTES:
            return cur.scalars(item_type, n, what)  # checked above: fits in what remains
        if item_type == _STRING:
            return cur.strings(n, what)
        # n <= remaining / 8: the loop is bounded by the file size
        return [_read_value(cur, item_type, depth + 1, what) for _ in range(n)]
    raise _Corrupt(cur.pos, f"{what} has unknown value type {value_type}")


def _read_kv(cur: _Cursor, fields: dict) -> None:
    """Read and check one key/value into `fields`."""
    start = cur.pos
    key = cur.string("metadata key").decode()
    if key in fields:
        raise _Corrupt(start, f"metadata key {key!r} appears twice")
    value_type = cur.unpack("I", f"type of metadata key {key!r}")
    if key == "general.alignment":
        if value_type != _UINT32:
            raise _Corrupt(start, "general.alignment is not a uint32")
        alignment = cur.unpack("I", "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise _Corrupt(start, f"general.alignment {alignment} is not a power of two")
        fields[key] = alignment
        return
    fields[key] = _read_value(cur, value_type, 0, f"value of metadata key {key!r}")


def _read_tensor_info(cur: _Cursor, names: set[bytes]) -> TensorInfo:
    """Read and check one tensor info."""
    start = cur.pos
    name = cur.string("tensor name")
    label = f"tensor {name.decode()!r}"
    if name in names:
        raise _Corrupt(start, f"{label} appears twice")
    names.add(name)
    n_dims = cur.unpack("I", f"{label} dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Corrupt(start, f"{label} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = [cur.unpack("Q", f"{label} dimensions") for _ in range(n_dims)]
    type_id = cur.unpack("I", f"{label} type")
    offset = cur.unpack("Q", f"{label} offset")
    sizes = GGML_QUANT_SIZES.get(type_id)  # keyed by an IntEnum: plain ints look up the same entries
    if sizes is None:
        raise _Corrupt(start, f"{label} has unknown ggml type {type_id}")
    block_size, type_size = sizes
    if dims[0] % block_size:
        raise _Corrupt(start, f"{label} row length {dims[0]} is not a multiple of its block size {block_size}")
    elements = 1
    for d in dims:  # Python ints: no overflow; a product beyond the file size is caught by the caller
        elements *= d
    return TensorInfo(name.decode(), tuple(dims), type_id, offset, elements // block_size * type_size)


def _scan(buf, file_bytes: int) -> GGUFHeader:
    if file_bytes < 24:
        raise _Corrupt(0, f"the file is {file_bytes} bytes, shorter than the 24-byte GGUF preamble")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise _Corrupt(0, "the file does not start with the bytes 'GGUF'")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a big-endian machine (the `gguf` reader's own test)
        (version,), order = struct.unpack_from(">I", buf, 4), ">"
    if version not in SUPPORTED_VERSIONS:
        raise _Corrupt(4, f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
    cur = _Cursor(buf, order)
    cur.pos = 8
    num_tensors = cur.count("tensor count", _MIN_TENSOR_INFO)
    num_kv = cur.count("key/value count", _MIN_KV)
    fields: dict = {}
    for _ in range(num_kv):
        _read_kv(cur, fields)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    names: set[bytes] = set()
    tensors = tuple(_read_tensor_info(cur, names) for _ in range(num_tensors))
    data_offset = -(-cur.pos // alignment) * alignment
    # Tensor data must lie inside the file, aligned, and no two tensors may share bytes.
    end = data_offset
    previous: TensorInfo | None = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset % alignment:
            raise _Corrupt(
                data_offset, f"tensor {t.name!r} offset {t.offset} is not a multiple of the alignment {alignment}"
            )
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise _Corrupt(data_offset, f"tensors {previous.name!r} and {t.name!r} overlap")
        end = max(end, data_offset + t.offset + t.nbytes)
        previous = t
    if end > file_bytes:
        raise _Truncated(end - data_offset, max(0, file_bytes - data_offset))
    return GGUFHeader(version, order, num_tensors, num_kv, data_offset, file_bytes, fields, tensors)


def scan_gguf_header(path: str | Path) -> GGUFHeader:
    """Check the whole header of the GGUF file at `path`; any defect is a ModelLoadError saying what to do."""
    path = Path(path)
    with open(path, "rb") as f:
        file_bytes = f.seek(0, 2)
        try:
            if file_bytes == 0:
                return _scan(b"", 0)
            # A read-only map: the OS pages in only the header bytes the scan touches.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(buf, file_bytes)
        except _Truncated as e:
            raise ModelLoadError(
                f"GGUF file {path} is truncated: expected {e.expected} bytes of tensor data, found {e.found}; "
                "re-download it, or re-assemble a bundled model with `leanlm models pull NAME`"
            ) from None
        except _Corrupt as e:
            raise ModelLoadError(
                f"GGUF file {path} has a corrupt or truncated header ({e.what}, at byte {e.offset}); re-download "
                "it, or re-assemble a bundled model with `leanlm models pull NAME`"
            ) from None
