"""BlockPool: exact block ids, ref counts, LRU eviction order and the hash map of the prefix cache."""

import pytest

from leanlm.engine.block_pool import BlockPool


def ids(blocks):
    return [block.block_id for block in blocks]


def free_queue_ids(pool):
    """The free queue in eviction order; reads the private queue on purpose, to assert the exact order."""
    return list(pool._free_queue)


def test_fresh_pool_hands_out_blocks_in_order():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    first = pool.get_new_blocks(3)
    assert ids(first) == [0, 1, 2]
    assert ids(pool.get_new_blocks(1)) == [3]
    assert [b.ref_cnt for b in first] == [1, 1, 1]
    assert pool.num_free_blocks == 4 and pool.usage == 0.5


def test_get_new_blocks_raises_when_short_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3 KV blocks but only 2 of 2 are free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    assert pool.get_new_blocks(0) == []


def test_lru_order_with_reverse_free():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks[:2]))  # a request frees tail-first: 1 then 0
    pool.free_blocks([blocks[3]])
    assert free_queue_ids(pool) == [1, 0, 3]
    assert ids(pool.get_new_blocks(2)) == [1, 0]  # freed earliest, reused first
    assert free_queue_ids(pool) == [3]


def test_touch_shares_and_revives_free_blocks():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.is_shared(a) and not pool.is_shared(b)
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and not pool.is_shared(a) and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert free_queue_ids(pool) == [2, 3, 1]
    pool.touch([b])  # O(1) removal from the middle of the queue
    assert b.ref_cnt == 1 and free_queue_ids(pool) == [2, 3]


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="block 0 freed more often"):
        pool.free_blocks([block])


def test_cached_block_survives_free_and_is_evicted_on_reuse():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, 111)
    assert pool.get_cached_block(111) is a and a.block_hash == 111
    pool.free_blocks([b, a])
    assert pool.get_cached_block(111) is a  # freed but still revivable
    pool.touch([pool.get_cached_block(111)])
    assert a.ref_cnt == 1 and free_queue_ids(pool) == [2, 1]
    pool.free_blocks([a])
    assert free_queue_ids(pool) == [2, 1, 0]
    assert ids(pool.get_new_blocks(3)) == [2, 1, 0]  # reusing block 0 evicts its hash
    assert pool.get_cached_block(111) is None and a.block_hash is None
    assert pool.num_cached_blocks == 0


def test_cache_full_block_refuses_duplicates_and_recaching():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, 7)
    assert not pool.cache_full_block(b, 7)  # same tokens already cached in a
    assert b.block_hash is None and pool.get_cached_block(7) is a
    assert not pool.cache_full_block(a, 8)  # a block keeps its first hash
    assert pool.get_cached_block(8) is None


def test_prefix_caching_disabled():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, 5)
    assert pool.get_cached_block(5) is None and a.block_hash is None


def test_reset_prefix_cache_forgets_hashes():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert a.block_hash is None and b.block_hash is None
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2  # allocation is untouched


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)
