"""KVCacheManager: allocation, chained block hashes, prefix-cache hits and the leave-the-last-token rule."""

import pytest

from leanlm.engine.block_pool import BlockPool
from leanlm.engine.kv_cache import KVCacheManager, hash_block_tokens
from leanlm.engine.request import Request
from leanlm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_manager(num_blocks=8, enable_prefix_caching=True):
    return KVCacheManager(BlockPool(num_blocks, enable_prefix_caching), BLOCK_SIZE)


def make_request(request_id, token_ids, **params):
    return Request(request_id, token_ids, SamplingParams(**params))


def admit(kv, request):
    """What the scheduler does for a waiting request: look up, allocate the rest, count hits computed."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    block_ids = kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks)
    request.num_computed_tokens = num_hit
    return block_ids, num_hit


def test_allocate_whole_prompt_caches_full_blocks_only():
    kv = make_manager()
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    assert kv.num_free_blocks == 5 and kv.usage == 3 / 8
    blocks = kv.block_pool.blocks
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert (blocks[0].block_hash, blocks[1].block_hash, blocks[2].block_hash) == (h0, h1, None)
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_chunked_allocation_grows_the_block_list():
    kv = make_manager()
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 3) == [0]
    assert kv.block_pool.blocks[0].block_hash is None  # 3 of 4 slots known: not full yet
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 3) == [0, 1]
    assert kv.block_pool.blocks[0].block_hash is not None
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 4) == [0, 1, 2]
    assert kv.block_pool.blocks[1].block_hash is not None
    assert kv.block_pool.blocks[2].block_hash is None


def test_decode_token_fills_a_block_and_caches_it():
    kv = make_manager()
    req = make_request("a", [1, 2, 3])
    kv.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    req.append_output_token_ids(9)
    assert kv.allocate_slots(req, 1) == [0]  # the 4th token fills block 0 this step
    assert kv.block_pool.blocks[0].block_hash == hash_block_tokens(None, [1, 2, 3, 9])
    req.num_computed_tokens = 4
    req.append_output_token_ids(10)
    assert kv.allocate_slots(req, 1) == [0, 1]


def test_two_requests_share_a_prompt_prefix():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(10)))
    assert admit(kv, a) == ([0, 1, 2], 0)
    assert admit(kv, b) == ([0, 1, 3], 8)
    assert b.num_computed_tokens == 8
    shared = kv.block_pool.blocks[:2]
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert all(kv.block_pool.is_shared(blk) for blk in shared)
    assert kv.num_free_blocks == 4
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    assert kv.prefix_cache_hit_rate == 0.4
    kv.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1] and kv.num_free_blocks == 5


def test_full_hit_leaves_the_last_token_to_compute():
    kv = make_manager()
    a = make_request("a", list(range(8)))  # exactly two full blocks
    admit(kv, a)
    b = make_request("b", list(range(8)))
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit_blocks] == [0] and num_hit == 4
    assert kv.allocate_slots(b, 4, hit_blocks) == [0, 2]


def test_diverging_prompts_share_only_the_common_blocks():
    kv = make_manager()
    admit(kv, make_request("a", list(range(12))))
    b = make_request("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    assert admit(kv, b) == ([0, 3, 4, 5], 4)


def test_hit_on_freed_block_then_eviction_tail_first():
    kv = make_manager(num_blocks=8)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)  # queue: 3 4 5 6 7 then a's blocks tail-first: 2 1 0
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == []
    other = make_request("other", list(range(100, 121)))  # 21 tokens: 6 blocks
    assert admit(kv, other) == ([3, 4, 5, 6, 7, 2], 0)
    b = make_request("b", list(range(10)))
    hit_blocks, num_hit = kv.get_computed_blocks(b)  # 0 and 1 are free yet still cached
    assert [blk.block_id for blk in hit_blocks] == [0, 1] and num_hit == 8
    # Reusing block 1 for something else evicts its hash: the chain now stops after block 0.
    other.num_computed_tokens = 21
    other.append_output_token_ids([121, 122, 123, 124])
    assert kv.allocate_slots(other, 4) == [3, 4, 5, 6, 7, 2, 1]
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit_blocks] == [0] and num_hit == 4


def test_allocation_failure_changes_nothing():
    kv = make_manager(num_blocks=4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # free queue: 2 3 1 0, with 0 and 1 cached
    b = make_request("b", list(range(8)) + list(range(50, 62)))  # 20 tokens: 5 blocks > 4
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 12, hit_blocks) is None
    assert kv.num_free_blocks == 4 and [blk.ref_cnt for blk in hit_blocks] == [0, 0]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (8, 0)  # a failed admission is not counted
    assert kv.get_block_ids("b") == []
    # 4 blocks do fit, counting the two revived hits out of the free ones.
    c = make_request("c", list(range(8)) + list(range(50, 58)))
    assert admit(kv, c) == ([0, 1, 2, 3], 8)
    assert kv.num_free_blocks == 0


def test_running_request_cannot_grow_past_the_pool():
    kv = make_manager(num_blocks=2)
    req = make_request("a", list(range(8)))
    assert kv.allocate_slots(req, 8) == [0, 1]
    req.num_computed_tokens = 8
    req.append_output_token_ids(8)
    assert kv.allocate_slots(req, 1) is None
    assert kv.get_block_ids("a") == [0, 1]


def test_prompt_logprobs_requests_skip_the_lookup():
    kv = make_manager()
    admit(kv, make_request("a", list(range(10))))
    b = make_request("b", list(range(10)), prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.allocate_slots(b, 10) == [3, 4, 5]
    assert kv.prefix_cache_queries == 10  # only a's lookup counted


def test_prefix_caching_disabled_never_hits():
    kv = make_manager(enable_prefix_caching=False)
    admit(kv, make_request("a", list(range(10))))
    b = make_request("b", list(range(10)))
    assert admit(kv, b) == ([3, 4, 5], 0)
    assert all(blk.block_hash is None for blk in kv.block_pool.blocks)


def test_reset_prefix_cache():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)


def test_hashes_are_computed_once_and_kept_across_preemption():
    kv = make_manager()
    req = make_request("a", list(range(10)))
    admit(kv, req)
    hashes = kv._req_to_hashes["a"]
    kv.free(req, keep_hashes=True)
    assert kv._req_to_hashes["a"] is hashes
    req.num_computed_tokens = 0
    assert admit(kv, req) == ([0, 1, 3], 8)  # resumes on its own cached head; the tail comes from the queue front
    kv.free(req)
    assert "a" not in kv._req_to_hashes


def test_lookup_after_allocation_is_refused():
    kv = make_manager()
    req = make_request("a", list(range(10)))
    admit(kv, req)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        kv.get_computed_blocks(req)


# ---- fork and copy-on-write -------------------------------------------------------------------------


def fork_of(parent, child_id, new_token):
    """A request with the parent's computed tokens plus one new token, computed up to it (as beam search)."""
    child = make_request(child_id, parent.all_token_ids[: parent.num_computed_tokens] + [new_token])
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def computed_parent(kv, num_tokens):
    """A request holding blocks for its num_tokens prompt tokens, all with KV."""
    parent = make_request("p", list(range(num_tokens)))
    kv.allocate_slots(parent, num_tokens)
    parent.num_computed_tokens = num_tokens
    return parent


def ref_cnts(kv):
    return [blk.ref_cnt for blk in kv.block_pool.blocks]


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    kv = make_manager()
    parent = make_request("p", list(range(6)))
    assert kv.allocate_slots(parent, 6) == [0, 1]
    parent.num_computed_tokens = 6
    a, b = fork_of(parent, "a", 100), fork_of(parent, "b", 101)
    assert kv.fork(parent, a) == [0, 1] and kv.fork(parent, b) == [0, 1]
    assert ref_cnts(kv)[:3] == [3, 3, 0] and kv.num_free_blocks == 6
    # a writes slot 6, inside block 1 which p and b hold too: it gets a fresh copy of block 1.
    assert kv.allocate_slots(a, 1) == [0, 2]
    assert kv.take_block_copies() == [(1, 2)]
    assert kv.take_block_copies() == []  # drained
    assert ref_cnts(kv)[:3] == [3, 2, 1]
    kv.free(parent)  # block 1 is now b's alone: b writes in place, no copy
    assert kv.allocate_slots(b, 1) == [0, 1]
    assert kv.take_block_copies() == []
    assert ref_cnts(kv)[:3] == [2, 1, 1]
    kv.free(a)
    kv.free(b)
    assert ref_cnts(kv) == [0] * 8 and kv.num_free_blocks == 8


def test_fork_at_a_block_boundary_shares_full_blocks_only():
    kv = make_manager()
    parent = computed_parent(kv, 8)
    child = fork_of(parent, "c", 100)
    assert kv.fork(parent, child) == [0, 1]
    assert kv.allocate_slots(child, 1) == [0, 1, 2]  # its token starts a new block: nothing to copy
    assert kv.take_block_copies() == []
    assert ref_cnts(kv)[:3] == [2, 2, 1]


def test_a_running_parent_copies_too_when_it_writes_first():
    kv = make_manager()
    parent = computed_parent(kv, 5)
    child = fork_of(parent, "c", 100)
    kv.fork(parent, child)
    parent.append_output_token_ids(7)
    assert kv.allocate_slots(parent, 1) == [0, 2]
    assert kv.take_block_copies() == [(1, 2)]
    assert kv.allocate_slots(child, 1) == [0, 1]  # the shared block is the child's alone now
    assert ref_cnts(kv)[:3] == [2, 1, 1]


def test_fork_keeps_the_prefix_cache_hashes():
    kv = make_manager()
    parent = computed_parent(kv, 10)
    child = fork_of(parent, "c", 100)
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1) == [0, 1, 3]
    assert kv.take_block_copies() == [(2, 3)]
    child.num_computed_tokens = 11
    child.append_output_token_ids(101)  # 12 tokens: the copied block 3 fills up and is cached under c's tokens
    assert kv.allocate_slots(child, 1) == [0, 1, 3]
    h1 = hash_block_tokens(hash_block_tokens(None, [0, 1, 2, 3]), [4, 5, 6, 7])
    assert kv.block_pool.blocks[3].block_hash == hash_block_tokens(h1, [8, 9, 100, 101])
    kv.free(parent)
    kv.free(child)
    # A new request with the child's tokens hits all three blocks.
    again = make_request("again", list(range(10)) + [100, 101, 5])
    assert admit(kv, again) == ([0, 1, 3, 4], 12)


def test_copy_on_write_that_finds_no_block_changes_nothing():
    kv = make_manager(num_blocks=2)
    parent = computed_parent(kv, 6)
    child = fork_of(parent, "c", 100)
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1) is None  # the copy needs a third block
    assert kv.get_block_ids("c") == [0, 1] and ref_cnts(kv) == [2, 2]
    assert kv.take_block_copies() == []
    kv.free(parent)
    assert kv.allocate_slots(child, 1) == [0, 1]  # alone now: writes in place


def test_fork_refuses_tokens_or_counts_that_do_not_match():
    kv = make_manager()
    parent = computed_parent(kv, 6)
    other = make_request("x", [9, 9, 9, 9, 9, 9, 9])
    other.num_computed_tokens = 6
    with pytest.raises(ValueError, match="differ"):
        kv.fork(parent, other)
    ahead = make_request("y", list(range(8)))
    ahead.num_computed_tokens = 7
    with pytest.raises(ValueError, match="has KV for only 6"):
        kv.fork(parent, ahead)
    child = fork_of(parent, "c", 100)
    kv.fork(parent, child)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        kv.fork(parent, child)
    assert ref_cnts(kv)[:2] == [2, 2]


def test_a_retention_window_releases_the_blocks_behind_it():
    """Window 8 + 2 sinks in blocks of 4: before a step from token c on, blocks wholly below c + 1 - 8 go back to the
    pool, except block 0 (the sinks); their places in the table read 0 and the pool reuses them."""
    from leanlm.engine.kv_cache import KVRetention

    pool = BlockPool(num_blocks=10, enable_prefix_caching=False)
    kv = KVCacheManager(pool, block_size=4, retention=KVRetention(window=8, sinks=2, max_step_tokens=4))
    req = make_request("r", list(range(40)))
    assert kv.allocate_slots(req, 8) == [0, 1]
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 4) == [0, 1, 2]  # next query at 8 reads 1 ..: nothing wholly before it
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 4) == [0, 1, 2, 3]  # reads 5 ..: block 1 (4-7) is still partly in the window
    req.num_computed_tokens = 16
    assert kv.allocate_slots(req, 4) == [0, 0, 2, 3, 4]  # reads 9 ..: block 1 released, its slot reads 0
    assert kv.num_held_blocks("r") == 4 and pool.num_free_blocks == 6
    req.num_computed_tokens = 20
    assert kv.allocate_slots(req, 4) == [0, 0, 0, 3, 4, 5]  # block 2 released (to the free queue's tail)
    assert kv.num_held_blocks("r") == 4 and pool.num_free_blocks == 6
    assert kv.peak_blocks(10_000) == 1 + 3 + 1  # sinks' block + window and a step (12 tokens) + a partial one
    kv.free(req)
    assert pool.num_free_blocks == 10
