"""Reading part of a row-major tensor straight from its file: rows [r0, r1) and, within each row, bytes [c0, c1),
by positioned reads through a bounded buffer. Only the slice is copied into this process (a memory map would
count every page the slice touches, every page of a column slice, in the process's resident memory)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

CHUNK_BYTES = 8 << 20  # one read's buffer: bounds what a column slice costs beyond the slice itself


def read_block(path: str | Path, offset: int, row_bytes: int, rows: slice, cols: slice | None = None) -> np.ndarray:
    """uint8 [r1 - r0, c1 - c0] (cols None: whole rows) of the tensor whose row 0 starts at byte `offset` of the
    file and whose rows are `row_bytes` long. The caller has checked the tensor's byte range against the file."""
    r0, r1 = rows.start, rows.stop
    c0, c1 = (0, row_bytes) if cols is None else (cols.start, cols.stop)
    if not (0 <= r0 <= r1 and 0 <= c0 <= c1 <= row_bytes):
        raise ValueError(f"rows [{r0}, {r1}) x bytes [{c0}, {c1}) is no slice of rows of {row_bytes} bytes")
    out = np.empty((r1 - r0, c1 - c0), dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        if c0 == 0 and c1 == row_bytes:  # whole rows: one contiguous range, read in place
            _read_into(fd, memoryview(out).cast("B"), offset + r0 * row_bytes)
            return out
        per_chunk = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for start in range(r0, r1, per_chunk):
            stop = min(r1, start + per_chunk)
            buf = np.empty((stop - start, row_bytes), dtype=np.uint8)
            _read_into(fd, memoryview(buf).cast("B"), offset + start * row_bytes)
            out[start - r0 : stop - r0] = buf[:, c0:c1]
    finally:
        os.close(fd)
    return out


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from the file at `offset` (positioned reads may return short)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"the file ended {len(view) - done} bytes before the tensor did (truncated?)")
        done += n
