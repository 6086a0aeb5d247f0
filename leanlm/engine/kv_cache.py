"""KVCacheManager: which blocks each request holds, automatic prefix caching over chained block hashes, and
forks that share blocks copy-on-write (PagedAttention, Kwon et al. 2023; the hash-chain prefix cache of vLLM v1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leanlm.engine.block_pool import BlockPool, KVBlock
from leanlm.engine.kv_budget import Compaction, KVBudget
from leanlm.engine.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block: chains the previous block's hash, so equal hashes mean equal prefixes
    (up to 64-bit collisions). Python's hash of ints and tuples is not salted, so it is stable."""
    return hash((parent_hash, tuple(token_ids)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Where a released block stood in a request's list: its position's KV is read by no query any more (it left every
# layer's window). Never in the pool: a reference count no release reaches keeps it "shared", so nothing writes,
# frees, swaps or copies it; its id fills the block table's slot, which no kernel reads.
_RELEASED = KVBlock(block_id=0, ref_cnt=1 << 62)


@dataclass(frozen=True)
class KVRetention:
    """The KV a sequence keeps when every layer's queries read a bounded window: its first `sinks` tokens and the
    last `window` before any query (leanlm.model.attention_pattern.kv_retention)."""

    window: int
    sinks: int = 0
    max_step_tokens: int = 1  # the most tokens one step adds to a sequence (a prompt chunk)


class KVCacheManager:
    """Per-request block lists over one BlockPool.

    Invariant: request r holds blocks covering its `r.num_kv_tokens` KV slots (its computed tokens less those a KV
    budget evicted) (plus whatever was
    allocated for the step being run); `_num_cached_blocks[r]` leading blocks are registered in the cache.
    Copy-on-write: a block several requests hold (a fork's, or a prefix hit's) is never written; only a
    fork can share a partially filled block, and allocate_slots swaps it for a private copy before a write.
    """

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        kv_budget: KVBudget | None = None,
        retention: KVRetention | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        self.retention = retention  # None: every token's KV stays until the request ends
        self._req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Hashes of each request's full blocks, computed once; survive preemption (tokens never change).
        self._req_to_hashes: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens of admitted requests that were looked up
        self.prefix_cache_hits = 0  # of those, tokens served from the cache
        # (src, dst) block ids whose KV the runner must copy before the next forward; take_block_copies drains it
        self._block_copies: list[tuple[int, int]] = []
        # Swapped-out requests: their block lists with None where a private block went to host memory (swap_out);
        # the shared blocks stay held. A request is in _req_to_blocks or here, never both.
        self._swapped: dict[str, list[KVBlock | None]] = {}
        # Requests past their KV budget give back blocks (evict_over_budget); the runner moves their kept tokens
        # first (take_compactions). A budgeted request's blocks are never shared: no prefix cache, no fork.
        self.kv_budget = kv_budget
        self._compactions: list[Compaction] = []

    @property
    def enable_prefix_caching(self) -> bool:
        return self.block_pool.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once: all of them, or under a retention its
        sinks' blocks, the window's and one step's tokens (plus a partly read block at each end)."""
        if self.retention is None:
            return self.num_blocks_for(num_tokens)
        r = self.retention
        bounded = self.num_blocks_for(r.sinks) + self.num_blocks_for(r.window + r.max_step_tokens) + 1
        return min(self.num_blocks_for(num_tokens), bounded)

    def too_big_message(self, request_id: str, num_tokens: int) -> str:
        """Why a request of `num_tokens` tokens can never run on this pool, and what to do."""
        return (
            f"request {request_id!r} needs {self.peak_blocks(num_tokens)} KV blocks for {num_tokens} "
            f"tokens but the pool has only {self.block_pool.num_blocks} blocks of {self.block_size} tokens; "
            f"give the engine more KV cache memory (num_kv_blocks) or lower max_model_len / the prompt length"
        )

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds now (released ones not counted)."""
        return sum(1 for block in self._req_to_blocks.get(request_id, ()) if block is not _RELEASED)

    def _release_behind_window(self, request: Request, blocks: list[KVBlock]) -> list[KVBlock]:
        """Give the pool back the blocks whose tokens no query from request.num_computed_tokens on reads: past the
        sinks' blocks and wholly before the window of the earliest such query."""
        r = self.retention
        if r is None or not blocks:
            return blocks
        first_read = request.num_computed_tokens + 1 - r.window  # the window's start for the next query
        end = min(len(blocks), max(0, first_read) // self.block_size)  # blocks [.., end) hold only older tokens
        start = self.num_blocks_for(r.sinks)
        gone = [i for i in range(start, end) if blocks[i] is not _RELEASED]
        if not gone:
            return blocks
        self.block_pool.free_blocks(blocks[i] for i in reversed(gone))
        blocks = list(blocks)
        for i in gone:
            blocks[i] = _RELEASED
        self._req_to_blocks[request.request_id] = blocks
        return blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks matching the request's tokens, and the tokens they cover.

        At least the last token is left uncomputed: the model must run on >= 1 token to give logits.
        Requests asking for prompt logprobs or a mean-pooled embedding skip the lookup: they need every prompt
        position computed.
        """
        if not self.enable_prefix_caching or request.needs_every_prompt_token:
            return [], 0
        if self._is_budgeted(request):
            return [], 0
        if self._req_to_blocks.get(request.request_id):
            raise RuntimeError(f"request {request.request_id!r} already holds blocks; look up only before allocating")
        hashes = self._block_hashes(request, request.num_tokens // self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Make the request hold blocks for num_computed + len(new_computed_blocks) * block_size +
        num_new_tokens tokens. Takes a reference on the prefix-hit blocks. Returns all its block ids, or
        None (changing nothing) when the pool cannot provide the blocks."""
        request_id = request.request_id
        blocks = self._release_behind_window(request, self._req_to_blocks.get(request_id, []))
        if new_computed_blocks and blocks:
            raise RuntimeError(f"request {request_id!r}: prefix-hit blocks are only accepted before allocation")
        num_computed = request.num_kv_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_for(num_total) - len(blocks) - len(new_computed_blocks))
        cow_idx = self._shared_write_block(request, blocks) if num_new_tokens > 0 else None
        # Free prefix-hit blocks leave the free queue when touched, so they cannot also be handed out new.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + (cow_idx is not None) > self.block_pool.num_free_blocks - num_revived:
            return None
        if not blocks:
            self._record_lookup(request, len(new_computed_blocks))
        if cow_idx is not None:
            blocks = self._copy_on_write(blocks, cow_idx)
        self.block_pool.touch(new_computed_blocks)  # before get_new_blocks, which could evict them
        blocks = blocks + list(new_computed_blocks) + self.block_pool.get_new_blocks(num_new_blocks)
        self._req_to_blocks[request_id] = blocks
        if new_computed_blocks:
            self._num_cached_blocks[request_id] = len(new_computed_blocks)
        self._cache_full_blocks(request, blocks, min(num_total, request.num_tokens))
        return [block.block_id for block in blocks]

    def fork(self, parent: Request, child: Request) -> list[int]:
        """Let `child` hold the blocks with parent's KV for child's first `num_computed_tokens` tokens, one more
        reference each; those tokens must be parent's first tokens, with KV computed. A write into a block both
        hold copies it first (allocate_slots), so neither sees the other's later tokens. Full blocks keep their
        hashes (the child shares parent's prefix-cache entries). Returns the child's block ids."""
        num_computed = child.num_computed_tokens
        if self._is_budgeted(parent) or self._is_budgeted(child):
            raise ValueError("a KV budget evicts per sequence: requests under one do not share KV blocks (no forks)")
        if self._req_to_blocks.get(child.request_id):
            raise RuntimeError(f"request {child.request_id!r} already holds blocks; fork only into a new request")
        if num_computed > parent.num_computed_tokens:
            raise ValueError(
                f"cannot fork {num_computed} computed tokens from request {parent.request_id!r}, which has KV for "
                f"only {parent.num_computed_tokens}"
            )
        if child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]:
            raise ValueError(f"the fork's first {num_computed} tokens differ from request {parent.request_id!r}'s")
        parent_blocks = self._req_to_blocks.get(parent.request_id, [])
        blocks = parent_blocks[: self.num_blocks_for(num_computed)]
        if len(blocks) < self.num_blocks_for(num_computed):
            raise RuntimeError(f"request {parent.request_id!r} holds no KV blocks for its computed tokens")
        self.block_pool.touch(block for block in blocks if block is not _RELEASED)
        self._req_to_blocks[child.request_id] = list(blocks)
        num_full = num_computed // self.block_size  # the child writes no token into these
        if parent.request_id in self._req_to_hashes:
            self._req_to_hashes[child.request_id] = self._req_to_hashes[parent.request_id][:num_full]
        self._num_cached_blocks[child.request_id] = min(self._num_cached_blocks.get(parent.request_id, 0), num_full)
        return [block.block_id for block in blocks]

    def evict_over_budget(self, request: Request) -> None:
        """A running request holding more than its KV budget + a block evicts down to the budget: its blocks past
        the budget's go back to the pool now, and a Compaction tells the runner to move the kept tokens (chosen by
        the policy's scores) into the first slots before the next forward writes. Its positions go on counting."""
        if self.kv_budget is None or not self.kv_budget.is_over(request):
            return
        blocks = self._req_to_blocks[request.request_id]
        kept = self.kv_budget.num_tokens
        ids = [block.block_id for block in blocks]
        self._compactions.append(Compaction(request.request_id, ids, request.num_kv_tokens, kept))
        request.num_evicted_tokens += request.num_kv_tokens - kept
        num_kept_blocks = self.num_blocks_for(kept)
        self.block_pool.free_blocks(reversed(blocks[num_kept_blocks:]))
        self._req_to_blocks[request.request_id] = blocks[:num_kept_blocks]

    def take_compactions(self) -> list[Compaction]:
        """The evictions recorded since the last call, for the runner (dropped for a request freed meanwhile)."""
        compactions, self._compactions = self._compactions, []
        return compactions

    def _is_budgeted(self, request: Request) -> bool:
        return self.kv_budget is not None and self.kv_budget.applies_to(request)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies recorded since the last call; the runner must do them before the forward
        that writes the new tokens. Copies are idempotent: nobody writes a src block's already computed slots."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def swap_out(self, request: Request) -> list[int]:
        """Release the request's private blocks (ref count 1), whose KV the caller copies to host memory, and keep
        its references on shared ones (prefix hits, forks: their KV stays on the device, held by others and by it).
        Returns the private block ids in block order; swap_in gives it fresh blocks in their places."""
        blocks = self._req_to_blocks.pop(request.request_id, [])
        private = [block for block in blocks if not self.block_pool.is_shared(block)]
        self._swapped[request.request_id] = [block if self.block_pool.is_shared(block) else None for block in blocks]
        # Freed blocks keep their hashes: until handed out again, a prefix hit may still revive them.
        self.block_pool.free_blocks(reversed(private))
        return [block.block_id for block in private]

    def num_blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks a swapped-out request needs to come back and compute `num_new_tokens` more: fresh blocks for
        its private ones, the blocks those tokens add, and a copy of a shared block they would write into."""
        layout = self._swapped[request.request_id]
        num_grow = max(0, self.num_blocks_for(request.num_kv_tokens + num_new_tokens) - len(layout))
        block_idx, offset = divmod(request.num_kv_tokens, self.block_size)
        kept = layout[block_idx] if block_idx < len(layout) else None
        cow = offset > 0 and kept is not None and self.block_pool.is_shared(kept)
        return layout.count(None) + num_grow + int(cow)

    def num_private_blocks(self, request: Request) -> int:
        """Blocks only this request holds: what a swap-out would copy to host memory."""
        blocks = self._req_to_blocks.get(request.request_id, ())
        return sum(1 for block in blocks if not self.block_pool.is_shared(block))

    def swap_in(self, request: Request) -> list[int] | None:
        """Give a swapped-out request fresh blocks where its private ones were; returns their ids (the order of
        swap_out's), or None (changing nothing) when the pool has too few free blocks. They carry no hash: the
        blocks swapped out may still hold their hashes, and a hash names one block."""
        layout = self._swapped[request.request_id]
        num_fresh = layout.count(None)
        if num_fresh > self.block_pool.num_free_blocks:
            return None
        fresh = self.block_pool.get_new_blocks(num_fresh)
        fresh_iter = iter(fresh)
        self._req_to_blocks[request.request_id] = [next(fresh_iter) if b is None else b for b in layout]
        del self._swapped[request.request_id]
        # The fresh blocks are not registered; leading ones counted as registered simply stay unshared.
        return [block.block_id for block in fresh]

    def free(self, request: Request, *, keep_hashes: bool = False) -> None:
        """Release the request's blocks tail-first (its tail is evicted before its shareable head) and
        forget it; a swapped-out request releases the shared blocks it kept. `keep_hashes` keeps its block
        hashes for a preempted request that will resume."""
        request_id = request.request_id
        swapped = self._swapped.pop(request_id, [])
        blocks = self._req_to_blocks.pop(request_id, [block for block in swapped if block is not None])
        self.block_pool.free_blocks(block for block in reversed(blocks) if block is not _RELEASED)
        self._num_cached_blocks.pop(request_id, None)
        request.num_evicted_tokens = 0  # no KV left: a resumed request computes every token again
        self._compactions = [c for c in self._compactions if c.request_id != request_id]
        if not keep_hashes:
            self._req_to_hashes.pop(request_id, None)

    def uncache_uncomputed(self, request: Request) -> list[int]:
        """Drop the prefix-cache hashes of the request's blocks past its computed tokens (registered when
        allocated, for a step that then failed), so no later request reuses KV that was never written.
        Returns the ids of those blocks."""
        blocks = self._req_to_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        self.block_pool.uncache(blocks[first:])
        if self._num_cached_blocks.get(request.request_id, 0) > first:
            self._num_cached_blocks[request.request_id] = first
        return [block.block_id for block in blocks[first:]]

    def reset_prefix_cache(self) -> int:
        """Drop every cached hash and the hit-rate counters; returns how many hashes were dropped."""
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        return self.block_pool.reset_prefix_cache()

    def _shared_write_block(self, request: Request, blocks: list[KVBlock]) -> int | None:
        """Index of the block the request's next token goes into when it is partially filled and held by
        others too (a fork's last block); None otherwise. Full shared blocks are never written again."""
        block_idx, offset = divmod(request.num_kv_tokens, self.block_size)
        if offset and block_idx < len(blocks) and self.block_pool.is_shared(blocks[block_idx]):
            return block_idx
        return None

    def _copy_on_write(self, blocks: list[KVBlock], block_idx: int) -> list[KVBlock]:
        """Swap blocks[block_idx] (shared) for a fresh block that will get its KV copied; drop one reference on
        the shared block (it stays held by the others, so it cannot reach the free queue here)."""
        shared = blocks[block_idx]
        (fresh,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([shared])
        self._block_copies.append((shared.block_id, fresh.block_id))
        return blocks[:block_idx] + [fresh] + blocks[block_idx + 1 :]

    def _record_lookup(self, request: Request, num_hit_blocks: int) -> None:
        """Hit-rate counters, in tokens. Counted when a request is admitted, not per lookup, so a queue head
        that waits for blocks over many steps is counted once."""
        if self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_known_tokens: int) -> None:
        """Register blocks full of known tokens by the end of this step. Safe to share at once: the runner
        writes every scheduled token's KV (per layer, for the whole batch) before attention reads it."""
        if not self.enable_prefix_caching or self._is_budgeted(request):
            return
        num_full = num_known_tokens // self.block_size
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        hashes = self._block_hashes(request, num_full)
        for block_idx in range(num_cached, num_full):
            if blocks[block_idx] is not _RELEASED:
                self.block_pool.cache_full_block(blocks[block_idx], hashes[block_idx])
        self._num_cached_blocks[request.request_id] = num_full

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Hashes of the request's first `num_full_blocks` blocks, extending the memoized list as needed."""
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        token_ids = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_full_blocks:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else request.prefix_salt
            hashes.append(hash_block_tokens(parent, token_ids[start : start + size]))
        return hashes[:num_full_blocks] if len(hashes) > num_full_blocks else hashes
