"""Routing policy of the data-parallel front: which replica serves a request. cache_aware follows SGLang's
cache-aware router (affinity to the replica that already holds the prompt's prefix, unless that replica is
overloaded), with hashes of the prompt's leading KV blocks in place of its character radix tree. Pure Python."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from leanlm.config.router import ROUTER_POLICIES


class NoReplicaError(RuntimeError):
    """No replica is in rotation (all dead or failing their health checks)."""


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's first full blocks: hash i stands for tokens [0, (i + 1) * block_size), as the
    engine's prefix cache keys a block by its tokens and its parent's. A partial last block is left out (the
    engine does not cache it either)."""
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
    hashes = []
    parent = 0
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return tuple(hashes)


class PrefixIndex:
    """Which replica was last sent which prefix block: an LRU map (block hash, replica) -> None of at most
    `capacity` entries. Approximate by design: a replica may have evicted a block the index still names."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, str], None] = OrderedDict()  # least recently used first
        self._num_entries: dict[str, int] = {}  # replica -> its entries (the tie-break toward emptier caches)

    def __len__(self) -> int:
        return len(self._entries)

    def num_entries(self, replica: str) -> int:
        return self._num_entries.get(replica, 0)

    def match_length(self, hashes: Sequence[int], replica: str) -> int:
        """Leading blocks of `hashes` that `replica` holds (a chain: block i counts only after 0..i-1)."""
        length = 0
        for block_hash in hashes:
            if (block_hash, replica) not in self._entries:
                break
            length += 1
        return length

    def insert(self, hashes: Sequence[int], replica: str) -> None:
        """Record that `replica` now holds these blocks (most recently used), evicting the oldest beyond capacity."""
        for block_hash in hashes:
            key = (block_hash, replica)
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._entries[key] = None
            self._num_entries[replica] = self._num_entries.get(replica, 0) + 1
            if len(self._entries) > self.capacity:
                (_, evicted), _ = self._entries.popitem(last=False)
                self._num_entries[evicted] -= 1

    def drop(self, replica: str) -> None:
        """Forget a replica (it died or restarted: its KV cache is gone)."""
        for key in [key for key in self._entries if key[1] == replica]:
            del self._entries[key]
        self._num_entries.pop(replica, None)


@dataclass(frozen=True)
class Route:
    """The router's answer for one request."""

    replica: str  # the replica's name (its base URL)
    matched_blocks: int  # leading prompt blocks the index says that replica holds (> 0: a prefix-affinity hit)
    reason: str  # "prefix" | "least_load" | "balance" (affinity overruled by load) | "round_robin"


class Router:
    """Chooses a replica per request and remembers which prefixes went where (under every policy, so that the
    affinity hits of round_robin can be counted against cache_aware's). Not thread-safe: the front calls it from
    its event loop only."""

    def __init__(
        self,
        policy: str = "cache_aware",
        balance_abs_threshold: int = 4,
        balance_rel_threshold: float = 1.5,
        capacity: int = 65536,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(capacity)
        self._num_round_robin = 0

    def choose(self, hashes: Sequence[int], loads: Mapping[str, int]) -> Route:
        """The replica for a prompt whose leading block hashes are `hashes`; `loads` maps each replica in rotation
        to its requests in flight (in a fixed order: ties go to the earlier one). Records the choice."""
        if not loads:
            raise NoReplicaError("no replica is in rotation: every replica is down or failing its health check")
        names = list(loads)
        if self.policy == "round_robin":
            replica, reason = names[self._num_round_robin % len(names)], "round_robin"
            self._num_round_robin += 1
        elif self.policy == "least_load":
            replica, reason = self._least_loaded(loads), "least_load"
        else:
            replica, reason = self._cache_aware(hashes, loads)
        matched = self.index.match_length(hashes, replica)
        self.index.insert(hashes, replica)
        return Route(replica, matched, reason)

    def forget(self, replica: str) -> None:
        self.index.drop(replica)

    def _least_loaded(self, loads: Mapping[str, int]) -> str:
        # Among equally loaded replicas the one with the fewest remembered blocks: distinct prefixes spread out
        # even when requests come one at a time (all loads 0).
        order = {name: i for i, name in enumerate(loads)}
        return min(loads, key=lambda name: (loads[name], self.index.num_entries(name), order[name]))

    def _cache_aware(self, hashes: Sequence[int], loads: Mapping[str, int]) -> tuple[str, str]:
        best, best_length = None, 0
        for name in loads:  # the longest match; among equal ones the first in order
            length = self.index.match_length(hashes, name)
            if length > best_length:
                best, best_length = name, length
        if best is None:
            return self._least_loaded(loads), "least_load"
        idlest = self._least_loaded(loads)
        if self.is_overloaded(loads[best], loads[idlest]):
            return idlest, "balance"
        return best, "prefix"

    def is_overloaded(self, load: int, min_load: int) -> bool:
        """SGLang's rule: both the absolute and the relative gap to the idlest replica exceed their thresholds."""
        return load - min_load > self.balance_abs_threshold and load > self.balance_rel_threshold * min_load
