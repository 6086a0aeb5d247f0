"""Where offloaded decoder layers live while they are not resident (leanlm.model.offload): a safetensors file read
back with pread on a background thread (CPU), or pinned host memory copied to the GPU on a side stream."""

from __future__ import annotations

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
        """Begin materializing layer idx's tensors on the model's device; fresh tensors every call."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Entry:
    """One stored tensor: its dtype and shape, and where its bytes are in the layer's file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


class FileStore:
    """CPU: each layer written once as a safetensors file, opened and unlinked at once (the data lives as long as
    the descriptor, and nothing is left on disk however the process ends). A read allocates fresh tensors and
    fills them with pread on one background thread, which drops the GIL while the kernel copies, so the read of
    layer i+1 overlaps the compute of layer i. pread, not mmap: the page cache holds the file, and the process's
    resident set holds only the layers materialized now."""

    def __init__(self, directory: str | Path | None = None) -> None:
        if directory is None:
            from leanlm.loading.registry import cache_dir

            directory = cache_dir() / "offload"
        self._dir = Path(directory)
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._files: dict[int, tuple[int, list[_Entry]]] = {}  # layer -> (fd, entries)
        self._aliases: dict[int, dict[str, str]] = {}  # layer -> {name: stored name} for tensors stored once
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
        os.close(fd)
        path = Path(name)
        save_file(stored, name)
        header = check_safetensors_header(path)
        with path.open("rb") as f:
            data_start = 8 + int.from_bytes(f.read(8), "little")  # the header length, then the header
        entries = []
        for key, t in stored.items():
            begin, end = header[key]["data_offsets"]
            entries.append(_Entry(key, t.dtype, tuple(t.shape), data_start + begin, end - begin))
        fd = os.open(path, os.O_RDONLY)
        path.unlink()
        self._files[idx] = (fd, entries)
        self._aliases[idx] = aliases

    def start(self, idx: int) -> Future:
        return self._pool.submit(self._read, idx)

    def _read(self, idx: int) -> dict[str, torch.Tensor]:
        fd, entries = self._files[idx]
        tensors = {}
        for e in entries:
            raw = torch.empty(e.nbytes, dtype=torch.uint8)
            view, done = memoryview(raw.numpy()), 0
            while done < e.nbytes:  # pread may return fewer bytes than asked
                got = os.preadv(fd, [view[done:]], e.offset + done)
                if got <= 0:
                    raise OSError(f"offloaded layer {idx}: the read of {e.key} stopped at byte {done} of {e.nbytes}")
                done += got
            tensors[e.key] = raw.view(e.dtype).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)
        for key, source in self._aliases[idx].items():
            tensors[key] = tensors[source]
        return tensors

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()


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
