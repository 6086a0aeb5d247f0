"""BlockPool: the KV cache's physical blocks as plain ints: ref counts, a free queue in LRU eviction order,
and a block-hash -> block map for automatic prefix caching (vLLM v1 / PagedAttention bookkeeping)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class KVBlock:
    """One physical KV block. Compared by identity: block_id is unique within its pool."""

    block_id: int  # index into the KV tensors, 0 .. num_blocks - 1
    ref_cnt: int = 0  # requests holding this block; 0 means it sits in the free queue
    block_hash: int | None = None  # chained hash of its tokens once full and cached; None otherwise


class BlockPool:
    """Owns every block. Invariant: a block is in the free queue iff its ref_cnt is 0.

    A free block keeps its hash (and its place in the hash map) until it is handed out again, so a
    prefix-cache hit can revive it; the free queue's order is the eviction order (front = evicted first).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # block_id -> block, oldest-freed first. OrderedDict gives O(1) removal from the middle.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block_hash -> the one block holding those tokens

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including cached ones that a prefix hit could still revive."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the front of the free queue (ref_cnt 1), evicting their hashes."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {num_blocks} KV blocks but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict_hash(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block holding the tokens with this hash, free or in use; does not touch it."""
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit); a free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order: blocks reaching 0 join the queue's tail,
        so callers pass a request's blocks tail-first to have its tail evicted before its head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: int) -> bool:
        """Register a full block under `block_hash`. Returns False (and leaves it uncached) when caching is
        off, the block is already cached, or another block already holds the same tokens."""
        if not self.enable_prefix_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Forget these blocks' hashes (their contents cannot be trusted); they stay allocated."""
        for block in blocks:
            self._evict_hash(block)

    def is_shared(self, block: KVBlock) -> bool:
        """True when several requests hold the block: it must be copied before anyone writes into it."""
        return block.ref_cnt > 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after new weights are loaded); returns how many were dropped.
        Blocks in use stay allocated; they simply stop being shareable."""
        num_dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return num_dropped

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            # Only the block that owns the map entry can carry the hash (cache_full_block ensures it).
            del self._cached[block.block_hash]
            block.block_hash = None
