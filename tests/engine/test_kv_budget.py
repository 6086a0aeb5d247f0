"""KVBudget and the KVCacheManager's side of it: who is budgeted, when a request is compacted, which blocks go back
(exact block ids), and the plan's slots against its positions after an eviction."""

import pytest

from leanlm.engine.block_pool import BlockPool
from leanlm.engine.kv_budget import Compaction, KVBudget
from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.outputs import SchedulerOutput
from leanlm.engine.request import Request
from leanlm.engine.step_plan import plan_step
from leanlm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_manager(budget=8, policy="h2o", num_blocks=16):
    return KVCacheManager(BlockPool(num_blocks), BLOCK_SIZE, KVBudget(budget, policy, BLOCK_SIZE))


def make_request(request_id, num_prompt, max_tokens=16):
    return Request(request_id, list(range(3, 3 + num_prompt)), SamplingParams(max_tokens=max_tokens))


def test_budget_applies_only_to_requests_that_can_outgrow_it():
    budget = KVBudget(20, "snapkv", BLOCK_SIZE)
    assert not budget.applies_to(make_request("a", 10, max_tokens=10))  # 20 tokens at most
    assert budget.applies_to(make_request("b", 10, max_tokens=11))
    assert budget.snapkv_window == 10  # the paper's 32, at most half the budget
    with pytest.raises(ValueError, match="at least 2"):
        KVBudget(1, "h2o", BLOCK_SIZE)
    with pytest.raises(ValueError, match="kv_eviction"):
        KVBudget(8, "lru", BLOCK_SIZE)


def test_eviction_frees_the_tail_blocks_and_records_a_compaction():
    kv = make_manager(budget=8)
    req = make_request("a", 13)
    assert kv.allocate_slots(req, 13) == [0, 1, 2, 3]
    req.num_computed_tokens = 12  # budget 8 + a block of 4: not over yet
    kv.evict_over_budget(req)
    assert kv.take_compactions() == [] and kv.get_block_ids("a") == [0, 1, 2, 3]
    req.num_computed_tokens = 13
    kv.evict_over_budget(req)
    assert kv.take_compactions() == [Compaction("a", [0, 1, 2, 3], 13, 8)]
    assert kv.get_block_ids("a") == [0, 1] and kv.num_free_blocks == 14
    assert (req.num_evicted_tokens, req.num_kv_tokens) == (5, 8)
    assert kv.allocate_slots(req, 1) == [0, 1, 4]  # the 9th slot opens a block; positions go on at 13


def test_freeing_a_request_forgets_its_evictions():
    kv = make_manager(budget=8)
    req = make_request("a", 13)
    kv.allocate_slots(req, 13)
    req.num_computed_tokens = 13
    kv.evict_over_budget(req)
    kv.free(req, keep_hashes=True)  # preempted before the runner compacted: nothing left to move
    assert kv.take_compactions() == [] and req.num_evicted_tokens == 0
    assert kv.num_free_blocks == 16


def test_budgeted_requests_neither_hit_nor_fill_the_prefix_cache():
    kv = make_manager(budget=8)
    short = make_request("short", 7, max_tokens=1)  # fits the budget: cached as usual
    kv.allocate_slots(short, 7)
    assert kv.block_pool.num_cached_blocks == 1
    long = make_request("long", 12)
    assert kv.get_computed_blocks(long) == ([], 0)
    kv.allocate_slots(long, 12)
    assert kv.block_pool.num_cached_blocks == 1
    with pytest.raises(ValueError, match="no forks"):
        kv.fork(long, make_request("child", 12))


def test_the_plan_writes_after_the_kept_slots_at_the_true_positions():
    req = make_request("a", 13)
    req.num_computed_tokens, req.num_evicted_tokens = 13, 5
    so = SchedulerOutput([req], [1], [[0, 1, 4]])
    req.append_output_token_ids(99)
    plan = plan_step(so, "cpu").plan
    assert plan.positions.tolist() == [13] and plan.seq_lens == [9]
