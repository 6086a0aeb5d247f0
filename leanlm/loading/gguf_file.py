"""A GGUF file opened for loading: metadata values and tensors as numpy views of a read-only memory map.

The header comes from gguf_header's bounded scan (which reads every value as it checks it); tensor data is
never copied here: each tensor's `data` is a view of the map, shaped the way `gguf.quants.dequantize` takes
it (quantized and bf16 types: [rows..., row_bytes] uint8; float and integer types: their dims, outermost
first). Big-endian files, which no llama.cpp build writes, go through `gguf.GGUFReader`, which byte-swaps.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from leanlm.loading.gguf_header import GGUFHeader, scan_gguf_header

# ggml types stored as plain numpy elements; every other type is blocks of bytes
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims, innermost first (GGUF's order; GGUFReader's `shape`)
    data: np.ndarray  # a view of the file map (see the module docstring)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # metadata key -> value (lists for arrays)
    tensors: list[GGUFTensor]
    mapped: np.memmap | None = None  # the map the tensors view (None: GGUFReader's copy of a big-endian file)

    def release_pages(self) -> None:
        """Drop the map's pages from this process's resident memory (they stay in the page cache; a later read
        of a view faults them in again: the map is read-only, so nothing is lost). A loader calls it after each
        tensor, so that reading a file costs the slices it copies, not every page it looked at."""
        if self.mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapped._mmap.madvise(mmap.MADV_DONTNEED)


def _tensor(mapped: np.ndarray, header: GGUFHeader, info) -> GGUFTensor:
    qtype = GGMLQuantizationType(info.type_id)
    start = header.data_offset + info.offset
    raw = mapped[start : start + info.nbytes]
    outer = tuple(reversed(info.dims))  # [..., rows, cols]
    if qtype in _PLAIN:
        data = raw.view(_PLAIN[qtype]).reshape(outer)
    else:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        data = raw.reshape(*outer[:-1], outer[-1] // block_size * type_size)
    return GGUFTensor(info.name, qtype, np.array(info.dims, dtype=np.uint64), data)


def read_gguf(path: str | Path) -> GGUFFile:
    """Scan and map a GGUF file (a damaged header raises ModelLoadError from the scan)."""
    path = Path(path)
    header = scan_gguf_header(path)
    if header.byte_order != "<":
        return _through_gguf_reader(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    return GGUFFile(path, header.fields, [_tensor(mapped, header, t) for t in header.tensors], mapped)


def _through_gguf_reader(path: Path) -> GGUFFile:
    reader = GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [GGUFTensor(t.name, t.tensor_type, t.shape, t.data) for t in reader.tensors]
    return GGUFFile(path, fields, tensors)
