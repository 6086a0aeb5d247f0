"""The routing policy alone: block hashes, the LRU prefix index, and each policy's choices (exact)."""

from __future__ import annotations

import pytest

from leanlm.fleet.router import NoReplicaError, PrefixIndex, Route, Router, prefix_block_hashes

A, B, C = "http://a", "http://b", "http://c"


def test_block_hashes_are_chained_full_blocks_only():
    hashes = prefix_block_hashes(list(range(10)), block_size=4, max_blocks=4)
    assert len(hashes) == 2  # tokens 8..9 are a partial block
    assert hashes == prefix_block_hashes(list(range(8)), 4, 4)
    assert prefix_block_hashes(list(range(100)), 4, 3) == prefix_block_hashes(list(range(12)), 4, 4)
    # the second block's hash depends on the first: same tokens 4..7 after other ones hash differently
    other = prefix_block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4, 4)
    assert other[1] != hashes[1]
    assert prefix_block_hashes([1, 2, 3], 4, 4) == ()
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes([1], 0, 4)


def test_index_matches_leading_chains_and_evicts_least_recent():
    index = PrefixIndex(capacity=3)
    index.insert([1, 2], A)
    assert index.match_length([1, 2, 3], A) == 2
    assert index.match_length([2], A) == 1
    assert index.match_length([5, 1], A) == 0  # a chain breaks at the first miss
    assert index.match_length([1], B) == 0
    index.insert([1], A)  # touch: 2 is now the oldest
    index.insert([7, 8], B)
    assert len(index) == 3
    assert index.match_length([1], A) == 1 and index.match_length([1, 2], A) == 1
    assert (index.num_entries(A), index.num_entries(B)) == (1, 2)
    index.drop(B)
    assert (len(index), index.num_entries(B)) == (1, 0)


def test_cache_aware_follows_the_prefix_then_spreads_new_prefixes():
    router = Router("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5)
    loads = {A: 0, B: 0}
    assert router.choose([11, 12], loads) == Route(A, 0, "least_load")
    # a new prefix goes to the replica with the fewest remembered blocks, though loads tie
    assert router.choose([21, 22], loads) == Route(B, 0, "least_load")
    assert router.choose([11, 12, 13], loads) == Route(A, 2, "prefix")
    assert router.choose([21, 99], {A: 0, B: 2}) == Route(B, 1, "prefix")  # a gap of 2 is not over 2


def test_cache_aware_gives_way_to_load_past_both_thresholds():
    router = Router("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5)
    router.choose([1], {A: 0, B: 0})
    assert router.choose([1], {A: 3, B: 0}) == Route(B, 0, "balance")  # 3 - 0 > 2 and 3 > 0
    assert router.choose([1], {A: 9, B: 9, C: 7}) == Route(A, 1, "prefix")  # 9 > 1.5 * 7, but 9 - 7 <= 2
    assert router.choose([1], {A: 12, B: 12, C: 9}) == Route(A, 1, "prefix")  # 12 - 9 > 2, 12 <= 1.5 * 9
    assert router.choose([1], {A: 15, B: 12, C: 9}) == Route(C, 0, "balance")


def test_round_robin_cycles_and_still_counts_affinity():
    router = Router("round_robin")
    loads = {A: 5, B: 0, C: 0}
    assert [router.choose([7], loads).replica for _ in range(4)] == [A, B, C, A]
    assert router.choose([7], loads) == Route(B, 1, "round_robin")


def test_least_load_ignores_prefixes():
    router = Router("least_load")
    assert router.choose([1], {A: 1, B: 0}) == Route(B, 0, "least_load")
    assert router.choose([1], {A: 0, B: 1}) == Route(A, 0, "least_load")


def test_forgotten_replica_loses_its_affinity_and_empty_rotation_is_an_error():
    router = Router("cache_aware")
    router.choose([1], {A: 0})
    router.forget(A)
    assert router.choose([1], {B: 0, A: 0}) == Route(B, 0, "least_load")
    with pytest.raises(NoReplicaError, match="no replica is in rotation"):
        router.choose([1], {})
    with pytest.raises(ValueError, match="policy must be one of"):
        Router("random")
