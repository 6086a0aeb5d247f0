"""Preemption by swapping (vLLM v0's swap preemption, beside recompute): the cost estimate that picks one, and the
Swapper, the scheduler's collaborator that swaps a request's private KV blocks out to host memory and back in.

Recompute drops a request's KV and prefills its tokens again: ~2 * params FLOPs a token. Swapping copies its private
blocks to host memory and back: 2 x their bytes over the copy bandwidth. `should_swap` weighs the two."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.request import Request, RequestStatus
from leanlm.engine.swap_space import SwapSpace

# Throughputs the estimate assumes, by device type: (prefill FLOP/s, device <-> host copy bytes/s). CPU: measured
# here (benchmarks/kv_swap_bench.py, SmolLM2 prefill and KV block copies, docs/kv_swap.md); CUDA: ~40% of an
# H100's dense bf16 peak for prefill and a PCIe 4 x16 link's pinned-memory rate (datasheets, not measured).
DEVICE_THROUGHPUT = {"cpu": (450e9, 6e9), "cuda": (4e14, 2e10)}


@dataclass(frozen=True)
class PreemptionCosts:
    """What 'auto' weighs for one engine: the price of recomputing a token and of swapping a block."""

    flops_per_token: float  # prefill FLOPs of one recomputed token: ~2 * parameters
    prefill_flops_per_s: float  # prefill throughput
    bytes_per_block: int  # host bytes of one swapped block: every layer's K, V (and 8-bit scales), of every cache
    swap_bytes_per_s: float  # device -> host and host -> device copy bandwidth

    def __post_init__(self) -> None:
        for name in ("flops_per_token", "prefill_flops_per_s", "bytes_per_block", "swap_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PreemptionCosts.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def estimate(cls, model: torch.nn.Module, bytes_per_block: int, device: torch.device | str) -> PreemptionCosts:
        """From the model's size and the device type's assumed throughputs (DEVICE_THROUGHPUT)."""
        flops, bandwidth = DEVICE_THROUGHPUT.get(torch.device(device).type, DEVICE_THROUGHPUT["cpu"])
        return cls(2.0 * count_layer_weights(model), flops, bytes_per_block, bandwidth)

    def recompute_seconds(self, num_tokens: int) -> float:
        """Prefilling `num_tokens` again."""
        return self.flops_per_token * num_tokens / self.prefill_flops_per_s

    def swap_seconds(self, num_blocks: int) -> float:
        """Copying `num_blocks` blocks out and back in."""
        return 2.0 * num_blocks * self.bytes_per_block / self.swap_bytes_per_s


def count_layer_weights(model: torch.nn.Module) -> int:
    """Weights a token's prefill multiplies through: the decoder layers' parameters and buffers (quantized layers
    keep theirs in buffers; packed ones count as stored), without the rotary tables; the head runs only on rows
    that sample, so it is left out."""
    layers = model.model.layers
    tensors = [*layers.parameters(), *(b for name, b in layers.named_buffers() if "rotary" not in name)]
    return sum(t.numel() for t in {id(t): t for t in tensors}.values())


def should_swap(mode: str, costs: PreemptionCosts, num_computed_tokens: int, num_private_blocks: int) -> bool:
    """Swap (True) or recompute a request with this much KV, of which `num_private_blocks` blocks would be copied.
    A request without computed tokens has nothing to keep; 'auto' swaps only when it is estimated cheaper."""
    if num_computed_tokens == 0 or mode == "recompute":
        return False
    if mode == "swap":
        return True
    return costs.swap_seconds(num_private_blocks) < costs.recompute_seconds(num_computed_tokens)


class Swapper:
    """The swapped-out requests, oldest first, and the block copies the runner owes them. Invariant: a swapped
    request holds host blocks for its private KV and device references on its shared blocks, and no others."""

    def __init__(
        self, mode: str, kv_cache_manager: KVCacheManager, swap_space: SwapSpace, costs: PreemptionCosts
    ) -> None:
        self.mode = mode
        self.kv_cache_manager = kv_cache_manager
        self.swap_space = swap_space
        self.costs = costs
        self.swapped: deque[Request] = deque()
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        self._swap_out: list[tuple[int, int]] = []  # (device, host) block ids, since take_swaps
        self._swap_in: list[tuple[int, int]] = []  # (host, device)
        self._swapped_in_ids: list[str] = []  # whose host blocks free once this step's copies are handed out

    def swap_out(self, request: Request) -> bool:
        """Swap a preempted request out if the estimate says so and host blocks are free; False (nothing changed)
        means the caller recomputes it."""
        kv = self.kv_cache_manager
        num_private = kv.num_private_blocks(request)
        if not should_swap(self.mode, self.costs, request.num_computed_tokens, num_private):
            return False
        if not self.swap_space.can_allocate(num_private):
            return False  # the swap space is full: recompute
        device_ids = kv.swap_out(request)
        host_ids = self.swap_space.allocate(request.request_id, len(device_ids))
        self._swap_out += zip(device_ids, host_ids)
        request.status = RequestStatus.SWAPPED
        request.num_swaps += 1
        self.num_swaps_out += 1
        self.swapped.append(request)
        return True

    def swap_in(self, request: Request) -> bool:
        """Bring back a swapped request (KV and num_computed_tokens as they were); False when the pool lacks blocks."""
        device_ids = self.kv_cache_manager.swap_in(request)
        if device_ids is None:
            return False
        self._swap_in += zip(self.swap_space.get_block_ids(request.request_id), device_ids)
        self._swapped_in_ids.append(request.request_id)  # freed after take_swaps: this step still reads them
        self.swapped.remove(request)
        request.status = RequestStatus.RUNNING
        self.num_swaps_in += 1
        return True

    def drop(self, request: Request) -> None:
        """Forget a swapped request that ends (abort, error) or falls back to recompute, freeing its host blocks;
        the caller frees the shared device blocks it kept (KVCacheManager.free)."""
        self.swapped.remove(request)
        self.swap_space.free(request.request_id)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (device, host) swap-outs and (host, device) swap-ins since the last call, for the runner to do before
        its next forward; host blocks swapped in become free for later steps."""
        swaps = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        for request_id in self._swapped_in_ids:
            self.swap_space.free(request_id)
        self._swapped_in_ids = []
        return swaps
