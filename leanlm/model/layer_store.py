"""Where offloaded decoder layers live while they are not resident (leanlm.model.offload): a memory-mapped
safetensors file whose pages are mapped in on a background thread and out after use (CPU), or pinned host memory
copied to the GPU on a side stream."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from leanlm.loading.safetensors_header import check_safetensors_header


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Pending(Protocol):
    def result(self) -> dict[str, torch.Tensor]:
        """The layer's tensors by name, ready for the current stream to use (blocks until they are)."""


class LayerStore(Protocol):
    def write(self, idx: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep layer idx's tensors (called once per layer, before its resident copies are released)."""

    def start(self, idx: int) -> Pending:
        """Begin materializing layer idx's tensors on the model's device."""

    def free(self, idx: int) -> None:
        """Layer idx's tensors from its last read are no longer used (the model holds placeholders)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Entry:
    """One stored tensor: its dtype and shape, and where its bytes are in the layer's file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


_MADV_DONTNEED, _MADV_WILLNEED, _MADV_POPULATE_READ = 4, 3, 22  # <sys/mman.h>; POPULATE_READ: Linux 5.14+


class _Madvise:
    """madvise through ctypes, which drops the GIL for the call (mmap.madvise holds it): populating a layer's
    page tables on the prefetch thread then overlaps the compute thread's work."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.can_populate = True

    def __call__(self, address: int, length: int, advice: int) -> bool:
        return length == 0 or self._libc.madvise(address, length, advice) == 0

    def populate(self, address: int, length: int) -> None:
        """Map the range's pages now, reading them from the file where the page cache lacks them."""
        if self.can_populate and self(address, length, _MADV_POPULATE_READ):
            return
        self.can_populate = False  # an older kernel: ask for readahead; the pages then map as the layer runs
        self(address, length, _MADV_WILLNEED)


@dataclass
class _MappedLayer:
    """One layer's file, mapped: its entries' views are made per read, from `base` (the whole mapping)."""

    mapping: mmap.mmap
    base: torch.Tensor  # uint8 [file bytes] over the mapping: the address madvise takes
    entries: list[_Entry]
    aliases: dict[str, str]  # name -> stored name, for a tensor the layer holds under two names


class FileStore:
    """CPU: each layer written once as a safetensors file, opened, unlinked at once (the data lives as long as its
    mapping, and nothing is left on disk however the process ends) and memory-mapped copy-on-write. A read runs
    on one background thread: madvise(MADV_POPULATE_READ) maps the layer's pages (from the page cache, or the
    disk), so layer i+1's faults overlap layer i's compute; the tensors are then views of the mapping, read in
    place, never copied. Releasing a layer unmaps its pages from the process (MADV_DONTNEED): the page cache keeps
    them, the process's resident set does not. safetensors lays tensors out by decreasing alignment, so every
    view is aligned to its element size."""

    def __init__(self, directory: str | Path | None = None) -> None:
        if directory is None:
            from leanlm.loading.registry import cache_dir

            directory = cache_dir() / "offload"
        self._dir = Path(directory)
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._layers: dict[int, _MappedLayer] = {}
        self._madvise = _Madvise()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leanlm-offload")

    def write(self, idx: int, tensors: dict[str, torch.Tensor]) -> None:
        stored, aliases, seen = {}, {}, {}
        for key, t in tensors.items():
            same = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if same in seen:  # one tensor under two names: stored once (safetensors refuses shared storage)
                aliases[key] = seen[same]
                continue
            seen[same] = key
            stored[key] = t.detach().to("cpu").contiguous()
        fd, name = tempfile.mkstemp(prefix=f"layer_{idx}-", suffix=".safetensors", dir=self._dir)  # private, 0600
        try:
            os.close(fd)
            save_file(stored, name)
            header = check_safetensors_header(name)
            with open(name, "rb") as f:
                data_start = 8 + int.from_bytes(f.read(8), "little")  # the header length, then the header
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        finally:
            os.unlink(name)
        entries = []
        for key, t in stored.items():
            begin, end = header[key]["data_offsets"]
            entry = _Entry(key, t.dtype, tuple(t.shape), data_start + begin, end - begin)
            if entry.offset % t.element_size():
                raise RuntimeError(f"offloaded {key} sits at byte {entry.offset}, not aligned to its {t.dtype}")
            entries.append(entry)
        base = torch.frombuffer(mapping, dtype=torch.uint8)
        self._layers[idx] = _MappedLayer(mapping, base, entries, aliases)
        self.free(idx)  # writing left the pages mapped

    def start(self, idx: int) -> Future:
        return self._pool.submit(self._read, idx)

    def _read(self, idx: int) -> dict[str, torch.Tensor]:
        layer = self._layers[idx]
        self._madvise.populate(layer.base.data_ptr(), layer.base.numel())
        tensors = {e.key: layer.base[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layer.entries}
        for key, source in layer.aliases.items():
            tensors[key] = tensors[source]
        return tensors

    def free(self, idx: int) -> None:
        """Layer idx's views are gone: take its pages out of the process's resident set."""
        layer = self._layers[idx]
        self._madvise(layer.base.data_ptr(), layer.base.numel(), _MADV_DONTNEED)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._layers.clear()  # each mapping closes with the last view of it


class _CudaPending:
    """Copies issued on the side stream; result() makes the current stream wait for them."""

    def __init__(self, tensors: dict[str, torch.Tensor], stream) -> None:
        self._tensors, self._stream = tensors, stream

    def result(self) -> dict[str, torch.Tensor]:
        current = torch.cuda.current_stream(self._stream.device)
        current.wait_stream(self._stream)
        for t in self._tensors.values():
            t.record_stream(current)  # allocated on the side stream, used and freed on this one
        return self._tensors


class PinnedStore:
    """GPU: each layer's tensors in page-locked host memory; a read copies them to the device on a side stream
    (non_blocking, so the copy runs beside the kernels of the layer computing now)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._host: dict[int, dict[str, torch.Tensor]] = {}

    def write(self, idx: int, tensors: dict[str, torch.Tensor]) -> None:
        host, seen = {}, {}
        for key, t in tensors.items():
            same = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            host[key] = seen.get(same)
            if host[key] is None:
                host[key] = seen[same] = t.detach().to("cpu").pin_memory()
        self._host[idx] = host

    def start(self, idx: int) -> _CudaPending:
        # the current stream's work so far (e.g. a cast that made these tensors) comes before the copies
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        copies, done = {}, {}
        with torch.cuda.stream(self._stream):
            for key, t in self._host[idx].items():
                if id(t) not in done:
                    done[id(t)] = t.to(self._device, non_blocking=True)
                copies[key] = done[id(t)]
        return _CudaPending(copies, self._stream)

    def free(self, idx: int) -> None:
        pass  # the device copies go when their last reference does (the allocator saw record_stream)

    def close(self) -> None:
        self._stream.synchronize()
        self._host.clear()


def make_store(device: torch.device, directory: str | Path | None = None) -> LayerStore:
    """The store for a model on `device`: a file on CPU, pinned host memory on CUDA."""
    if device.type == "cpu":
        return FileStore(directory)
    if device.type == "cuda":
        return PinnedStore(device)
    raise ValueError(f"weight offloading runs on cpu or cuda, not {device.type}: load the model on one of them")
