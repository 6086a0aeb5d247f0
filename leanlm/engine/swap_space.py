"""Swap space for preempted requests (vLLM v0's swap preemption): SwapSpace, the host blocks as plain ints (the
scheduler's side), and HostKVPool, the host tensors the runner copies KV blocks into and back out of (pinned
memory beside a GPU cache, so the copies are DMA; a separate CPU tensor pool beside a CPU cache)."""

from __future__ import annotations

from collections import deque

import torch

from leanlm.model.paged_kv import PagedKVCache


class SwapSpace:
    """Host block ids 0 .. num_blocks - 1 and which request holds which. Invariant: a host block is free, or held by
    exactly one swapped-out request (host blocks are never shared: only private device blocks are swapped out)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a swap space needs >= 1 host block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # lowest ids first: tests read exact ids
        self._held: dict[str, list[int]] = {}  # request id -> its host blocks, in the order it swapped them out

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, request_id: str, num_blocks: int) -> list[int]:
        """Take `num_blocks` host blocks for a request that holds none."""
        if request_id in self._held:
            raise RuntimeError(f"request {request_id!r} already holds host blocks; swap it in first")
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} host blocks but only {len(self._free)} are free")
        ids = [self._free.popleft() for _ in range(num_blocks)]
        self._held[request_id] = ids
        return ids

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._held.get(request_id, ()))

    def free(self, request_id: str) -> list[int]:
        """Give back the request's host blocks (swapped in, or the request ended while swapped out); returns them."""
        ids = self._held.pop(request_id, [])
        self._free.extend(ids)
        return ids


class HostKVPool:
    """Host copies of device caches' blocks: one PagedKVCache on the CPU per device cache (the target's, and a
    separate draft model's, indexed by the same block ids), each with `num_blocks` blocks, 8-bit scales included."""

    def __init__(self, device_caches: tuple[PagedKVCache, ...], num_blocks: int) -> None:
        pinned = any(cache.device.type == "cuda" for cache in device_caches)  # page-locked: DMA, no staging copy
        self.device_caches = device_caches
        self.host_caches = tuple(_host_like(cache, num_blocks, pinned) for cache in device_caches)
        self.num_blocks = num_blocks
        self.is_pinned = pinned

    @staticmethod
    def bytes_per_block(device_caches: tuple[PagedKVCache, ...]) -> int:
        """Host bytes one swapped block takes: values and scales of every layer of every cache."""
        return sum(cache.nbytes // cache.num_blocks for cache in device_caches)

    @classmethod
    def sized(cls, device_caches: tuple[PagedKVCache, ...], swap_space_bytes: int) -> HostKVPool:
        """As many host blocks as `swap_space_bytes` holds."""
        per_block = cls.bytes_per_block(device_caches)
        if swap_space_bytes < per_block:
            raise ValueError(
                f"swap_space_bytes={swap_space_bytes} holds no KV block (one needs {per_block} bytes); raise it, or "
                f"set it to 0 to preempt by recompute only"
            )
        return cls(device_caches, swap_space_bytes // per_block)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.host_caches)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy (device, host) block pairs out, then (host, device) pairs in. Out first: a block a request swapped
        out this step may be the one another swaps in, or writes, this step."""
        for device, host in zip(self.device_caches, self.host_caches):
            if swap_out:
                _copy(device, host, swap_out)
            if swap_in:
                _copy(host, device, swap_in)


def _host_like(cache: PagedKVCache, num_blocks: int, pinned: bool) -> PagedKVCache:
    """An uninitialized CPU cache shaped like `cache` but with `num_blocks` blocks: only swapped-out blocks are read,
    and each is written before (so untouched pages cost no memory on the CPU)."""
    shape = list(cache.kv.shape)
    shape[2] = num_blocks
    kv = torch.empty(shape, dtype=cache.dtype, pin_memory=pinned)  # [L, 2, n, Hkv, bs, D]
    scales = None
    if cache.scales is not None:
        scales = torch.empty(shape[:-1], dtype=cache.scales.dtype, pin_memory=pinned)  # [L, 2, n, Hkv, bs]
    return PagedKVCache(kv, scales, cache.first_layer)


def _copy(src: PagedKVCache, dst: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
    """Blocks src_ids[i] of `src` into dst_ids[i] of `dst`, every layer, values and scales: one gather on the
    source's device, one transfer, one scatter."""
    src_ids, dst_ids = (list(ids) for ids in zip(*pairs))
    src_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    dst_idx = torch.tensor(dst_ids, dtype=torch.long, device=dst.device)
    dst.kv[:, :, dst_idx] = src.kv[:, :, src_idx].to(dst.device)  # [L, 2, n, Hkv, bs, D]
    if src.scales is not None:
        dst.scales[:, :, dst_idx] = src.scales[:, :, src_idx].to(dst.device)  # [L, 2, n, Hkv, bs]
