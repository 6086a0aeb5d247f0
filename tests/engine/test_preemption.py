"""Swap preemption: the cost estimate, and the scheduler swapping requests out and in (exact block ids, driven by
the fake runner of test_scheduler, which moves its simulated KV through the swap space and checks every slot)."""

from __future__ import annotations

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.block_pool import BlockPool
from leanlm.engine.engine import LLMEngine
from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.preemption import (
    PreemptionCosts,
    Swapper,
    count_layer_weights,
    should_swap,
)
from leanlm.engine.request import RequestStatus
from leanlm.engine.scheduler import Scheduler
from leanlm.engine.swap_space import SwapSpace
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.engine.test_engine import _prompts
from tests.engine.test_scheduler import FakeRunner, assert_all_blocks_free, make_request, run, step

# recompute: 2e8 FLOPs a token at 1e11 FLOP/s = 2 ms a token; swap: 1 MB a block out and back at 1e10 B/s = 0.2 ms
COSTS = PreemptionCosts(flops_per_token=2e8, prefill_flops_per_s=1e11, bytes_per_block=10**6, swap_bytes_per_s=1e10)


def make_swap_scheduler(num_blocks=4, block_size=4, num_swap_blocks=8, mode="swap", costs=COSTS, **options):
    config = EngineConfig(
        block_size=block_size, num_kv_blocks=num_blocks, preemption_mode=mode, swap_space_bytes=1, **options
    )
    kv = KVCacheManager(BlockPool(num_blocks, config.enable_prefix_caching), block_size)
    swapper = Swapper(mode, kv, SwapSpace(num_swap_blocks), costs)
    return Scheduler(config, kv, 1000, (), swapper=swapper)


def assert_swap_space_free(sched):
    space = sched.swapper.swap_space
    assert space.num_free_blocks == space.num_blocks and not sched.swapper.swapped


# ---- the estimate ----------------------------------------------------------------------------------------


def test_costs_are_flops_over_throughput_and_twice_the_bytes_over_bandwidth():
    assert COSTS.recompute_seconds(100) == pytest.approx(0.2)
    assert COSTS.swap_seconds(10) == pytest.approx(2e-3)
    assert should_swap("auto", COSTS, num_computed_tokens=100, num_private_blocks=10)
    # 1000 blocks cost 0.2 s to swap, exactly as much as recomputing 100 tokens: a tie recomputes
    assert not should_swap("auto", COSTS, num_computed_tokens=100, num_private_blocks=1000)
    assert should_swap("auto", COSTS, num_computed_tokens=100, num_private_blocks=999)
    slow_link = PreemptionCosts(2e8, 1e11, 10**6, swap_bytes_per_s=1e6)
    assert not should_swap("auto", slow_link, num_computed_tokens=100, num_private_blocks=10)
    assert should_swap("swap", slow_link, num_computed_tokens=100, num_private_blocks=10)
    assert not should_swap("recompute", COSTS, num_computed_tokens=100, num_private_blocks=10)
    assert not should_swap("swap", COSTS, num_computed_tokens=0, num_private_blocks=0)  # nothing to keep


def test_costs_are_validated_and_estimated_from_the_model(make_tiny_engine):
    with pytest.raises(ValueError, match="swap_bytes_per_s must be > 0"):
        PreemptionCosts(2e8, 1e11, 10**6, swap_bytes_per_s=0)
    model = make_tiny_engine().model
    cfg = model.config
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert count_layer_weights(model) == cfg.num_hidden_layers * per_layer
    costs = PreemptionCosts.estimate(model, 4096, model.model.norm.weight.device)
    assert costs.flops_per_token == 2 * cfg.num_hidden_layers * per_layer and costs.bytes_per_block == 4096


# ---- the scheduler ---------------------------------------------------------------------------------------


def _three_requests(sched):
    a = make_request("a", range(8), max_tokens=4)
    b = make_request("b", range(100, 103), max_tokens=3)
    c = make_request("c", range(200, 203), max_tokens=3)
    for req in (a, b, c):
        sched.add_request(req)
    return a, b, c


def test_swap_out_keeps_the_kv_and_swap_in_brings_it_back_to_fresh_blocks():
    sched = make_swap_scheduler()
    runner = FakeRunner(4)
    a, b, c = _three_requests(sched)
    kv, space = sched.kv_cache_manager, sched.swapper.swap_space
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 8), ("b", 3), ("c", 3)] and out.block_ids == [[0, 1], [2], [3]]
    # a needs a third block: c, the newest, goes to host block 0 and keeps its 3 computed tokens.
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 1), ("b", 1)] and out.preempted_request_ids == ["c"]
    assert out.blocks_to_swap_out == [(3, 0)] and out.blocks_to_swap_in == [] and out.block_ids == [[0, 1, 3], [2]]
    assert c.status == RequestStatus.SWAPPED and c.num_computed_tokens == 3 and kv.get_block_ids("c") == []
    assert space.get_block_ids("c") == [0] and space.num_free_blocks == 7
    # b needs a second block and is the newest running: it swaps itself out to host block 1.
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 1)] and out.preempted_request_ids == ["b"] and out.blocks_to_swap_out == [(2, 1)]
    assert [r.request_id for r in sched.swapper.swapped] == ["c", "b"] and sched.stats().num_swapped == 2
    # Block 2 is free again: c, the oldest swapped, comes back into it and decodes in the same step; b does not
    # fit yet (its block and a new one for its next token).
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 1), ("c", 1)] and out.blocks_to_swap_in == [(0, 2)] and out.block_ids[1] == [2]
    assert a.is_finished and c.status == RequestStatus.RUNNING and space.get_block_ids("c") == []
    # a is done (its blocks 3, 1, 0 freed tail first): c grows into 3, b comes back into 1 and grows into 0.
    trace, out, _ = step(sched, runner)
    assert trace == [("c", 1), ("b", 1)] and out.blocks_to_swap_in == [(1, 1)]
    assert out.block_ids == [[2, 3], [1, 0]]
    run(sched, runner)
    assert a.output_token_ids == [8, 9, 10, 11]
    assert b.output_token_ids == [103, 104, 105] and c.output_token_ids == [203, 204, 205]
    assert (b.num_swaps, c.num_swaps, b.num_preemptions, c.num_preemptions) == (1, 1, 0, 0)
    stats = sched.stats()
    assert (stats.num_preemptions, stats.num_swaps_out, stats.num_swaps_in, stats.num_swapped) == (0, 2, 2, 0)
    assert_all_blocks_free(sched)
    assert_swap_space_free(sched)


def test_abort_and_failure_while_swapped_free_the_host_blocks():
    sched = make_swap_scheduler()
    runner = FakeRunner(4)
    a, b, c = _three_requests(sched)
    for _ in range(3):
        step(sched, runner)
    assert b.status == c.status == RequestStatus.SWAPPED and sched.swapper.swap_space.num_free_blocks == 6
    assert sched.abort_request("b") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert sched.swapper.swap_space.num_free_blocks == 7 and [r.request_id for r in sched.swapper.swapped] == ["c"]
    assert sched.finish_with_error("c", "boom") is c and c.status == RequestStatus.FINISHED_ERROR
    assert_swap_space_free(sched)
    run(sched, runner)
    assert a.output_token_ids == [8, 9, 10, 11] and b.output_token_ids == [103, 104] and c.output_token_ids == [203]
    assert_all_blocks_free(sched)


def test_a_full_swap_space_falls_back_to_recompute():
    sched = make_swap_scheduler(num_swap_blocks=1)
    runner = FakeRunner(4)
    a, b, c = _three_requests(sched)
    step(sched, runner)
    _, out, _ = step(sched, runner)
    assert out.blocks_to_swap_out == [(3, 0)] and c.status == RequestStatus.SWAPPED
    # b would need a second host block: it is preempted by recompute (KV dropped, waiting at the queue's head).
    _, out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["b"] and out.blocks_to_swap_out == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and list(sched.waiting) == [b]
    run(sched, runner)
    assert b.output_token_ids == [103, 104, 105] and c.output_token_ids == [203, 204, 205]
    stats = sched.stats()
    assert (stats.num_preemptions, stats.num_swaps_out, stats.num_swaps_in) == (1, 1, 1)
    assert_all_blocks_free(sched)
    assert_swap_space_free(sched)


def test_swapped_requests_that_cannot_come_back_with_nothing_running_fall_back_to_recompute():
    """Blocks held outside the queues (taken from the pool here) leave no room and nothing runs to free any: the
    swapped requests are recomputed instead of waiting forever, and then fail as any request that can never fit."""
    sched = make_swap_scheduler()
    runner = FakeRunner(4)
    a, b, c = _three_requests(sched)
    for _ in range(3):
        step(sched, runner)
    pool = sched.kv_cache_manager.block_pool
    sched.abort_request("a")
    taken = pool.get_new_blocks(pool.num_free_blocks)
    trace, out, changed = step(sched, runner)
    assert trace == [] and out.blocks_to_swap_in == [] and {r.request_id for r in changed} == {"b", "c"}
    assert b.status == c.status == RequestStatus.FINISHED_ERROR and "KV blocks" in c.error
    assert (b.num_swaps, b.num_preemptions, sched.stats().num_preemptions) == (1, 1, 2)
    assert_swap_space_free(sched)
    pool.free_blocks(taken)
    assert_all_blocks_free(sched)


def test_auto_recomputes_when_the_estimate_says_swapping_costs_more():
    slow_link = PreemptionCosts(2e8, 1e11, 10**6, swap_bytes_per_s=1e6)
    sched = make_swap_scheduler(mode="auto", costs=slow_link)
    runner = FakeRunner(4)
    _, _, c = _three_requests(sched)
    step(sched, runner)
    _, out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["c"] and c.status == RequestStatus.PREEMPTED and out.blocks_to_swap_out == []
    sched_fast = make_swap_scheduler(mode="auto")
    _, _, c_fast = _three_requests(sched_fast)
    step(sched_fast, runner)
    _, out, _ = step(sched_fast, runner)
    assert out.blocks_to_swap_out == [(3, 0)] and c_fast.status == RequestStatus.SWAPPED


def test_blocks_shared_with_a_prefix_hit_stay_on_the_device_and_only_private_ones_swap():
    sched = make_swap_scheduler(num_blocks=4)
    runner = FakeRunner(4)
    a = make_request("a", range(10), max_tokens=5)
    b = make_request("b", range(10), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    kv, pool = sched.kv_cache_manager, sched.kv_cache_manager.block_pool
    _, out, _ = step(sched, runner)
    assert out.block_ids == [[0, 1, 2], [0, 1, 3]]  # b hits a's two full blocks
    step(sched, runner)
    step(sched, runner)
    # a's 13th token needs a fourth block: b is swapped out, but only its private block 3 leaves the device; it
    # keeps its references on the shared blocks 0 and 1.
    _, out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["b"] and out.blocks_to_swap_out == [(3, 0)] and out.block_ids == [[0, 1, 2, 3]]
    assert [blk.ref_cnt for blk in pool.blocks] == [2, 2, 1, 1] and sched.swapper.swap_space.get_block_ids("b") == [0]
    _, out, _ = step(sched, runner)  # a finishes; b would need 2 blocks, none is free yet
    assert a.is_finished and out.blocks_to_swap_in == [] and [blk.ref_cnt for blk in pool.blocks] == [1, 1, 0, 0]
    # a's private blocks (3, 2 freed in that order) take b's copy back and its next token; a's writes into block
    # 3 are overwritten by b's own KV from the host.
    _, out, _ = step(sched, runner)
    assert out.blocks_to_swap_in == [(0, 3)] and out.block_ids == [[0, 1, 3, 2]]
    run(sched, runner)
    assert a.output_token_ids == b.output_token_ids == [10, 11, 12, 13, 14]
    assert kv.prefix_cache_hits == 8
    assert_all_blocks_free(sched)
    assert_swap_space_free(sched)


def test_aborting_a_swapped_request_releases_its_kept_shared_blocks():
    sched = make_swap_scheduler(num_blocks=4)
    runner = FakeRunner(4)
    a = make_request("a", range(10), max_tokens=5)
    b = make_request("b", range(10), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched, runner)
    assert b.status == RequestStatus.SWAPPED
    sched.abort_request("b")
    assert [blk.ref_cnt for blk in sched.kv_cache_manager.block_pool.blocks] == [1, 1, 1, 1]
    run(sched, runner)
    assert_all_blocks_free(sched)
    assert_swap_space_free(sched)


# ---- the engine end to end -------------------------------------------------------------------------------

TIGHT = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)  # forces preemption
MODES = {
    "none": dict(TIGHT, num_kv_blocks=256),
    "recompute": dict(TIGHT, preemption_mode="recompute"),
    "swap": dict(TIGHT, preemption_mode="swap", swap_space_bytes=1 << 20),
}


def _greedy_tokens(engine, prompts, max_tokens=20):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = run_to_completion(engine)
    return [outputs[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_recompute_and_no_preemption_give_the_same_greedy_tokens(make_tiny_engine, tokenizer, kv_cache_dtype):
    """float32 weights; an 8-bit cache is swapped with its scales (wrong scales would change the tokens)."""
    prompts = _prompts(tokenizer.vocab_size)
    tokens = {}
    for mode, options in MODES.items():
        engine = make_tiny_engine(dtype=torch.float32, kv_cache_dtype=kv_cache_dtype, **options)
        tokens[mode] = _greedy_tokens(engine, prompts)
        stats = engine.scheduler.stats()
        recomputed, swapped = stats.num_preemptions > 0, stats.num_swaps_out > 0
        assert (recomputed, swapped) == {"none": (False, False), "recompute": (True, False), "swap": (False, True)}[
            mode
        ]
        assert stats.num_swaps_in == stats.num_swaps_out and stats.num_swapped == 0
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
        if engine.scheduler.swapper is not None:
            assert_swap_space_free(engine.scheduler)
    assert tokens["swap"] == tokens["none"] == tokens["recompute"]


def test_auto_swaps_on_this_cpu_and_the_host_pool_is_sized_from_its_bytes(make_tiny_engine, tokenizer):
    engine = make_tiny_engine(dtype=torch.float32, **dict(TIGHT, swap_space_bytes=1 << 20))
    pool = engine.model_runner.host_kv_pool
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # L, K/V, block size, Hkv, D, float32
    assert pool.num_blocks == (1 << 20) // per_block and engine.scheduler.swapper.costs.bytes_per_block == per_block
    _greedy_tokens(engine, _prompts(tokenizer.vocab_size))
    stats = engine.scheduler.stats()
    assert stats.num_swaps_out > 0 and stats.num_preemptions == 0  # a CPU copy is far cheaper than a prefill
    assert make_tiny_engine(**TIGHT).model_runner.host_kv_pool is None  # swap_space_bytes 0: recompute only


def test_a_separate_draft_models_cache_is_swapped_with_the_targets(tokenizer):
    """A swapped request keeps its draft KV (num_preemptions stays 0, so the draft trusts what it wrote): each block
    of the draft's cache must come back as it left. A draft with the target's weights is then always accepted."""
    from tests.engine.test_spec_decode import GREEDY, _draft_engine, _repetitive_prompts

    engine = _draft_engine(
        tokenizer,
        noise=0.0,
        adaptive=False,
        block_size=4,
        num_kv_blocks=20,
        max_num_batched_tokens=12,
        preemption_mode="swap",
        swap_space_bytes=1 << 20,
    )
    runner = engine.model_runner
    pool = runner.host_kv_pool
    draft_cache = runner.spec_decoder.proposer.kv_cache
    assert pool.device_caches == (runner.kv_cache, draft_cache)
    left, checked = {}, []  # host block -> the draft block's KV when it left; blocks compared on return
    swap = pool.swap

    def checking_swap(swap_out, swap_in):
        left.update({host: draft_cache.kv[:, :, device].clone() for device, host in swap_out})
        swap(swap_out, swap_in)
        checked.extend(torch.equal(draft_cache.kv[:, :, device], left.pop(host)) for host, device in swap_in)

    pool.swap = checking_swap
    for prompt in _repetitive_prompts(tokenizer.vocab_size):
        engine.add_request(prompt, GREEDY)
    run_to_completion(engine)
    assert checked and all(checked)
    stats = runner.spec_decoder.stats()
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert engine.scheduler.stats().num_swaps_out > 0 and engine.scheduler.stats().num_preemptions == 0


@pytest.mark.real_model
def test_real_model_swap_recompute_and_no_preemption_give_the_same_greedy_tokens(smollm):
    """SmolLM2 in float32, three prompts in a 6-block pool of 16-token blocks (each needs 3 blocks by the end)."""
    model = build_model(smollm.config, smollm.state_dict, torch.float32, quantized=smollm.quantized)
    texts = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,")
    prompts = [smollm.tokenizer.encode(t) for t in texts]
    tight = dict(block_size=16, num_kv_blocks=6, max_num_batched_tokens=64)
    modes = {
        "none": dict(tight, num_kv_blocks=64),
        "recompute": dict(tight, preemption_mode="recompute"),
        "swap": dict(tight, preemption_mode="swap", swap_space_bytes=64 << 20),
    }
    tokens, stats = {}, {}
    for mode, options in modes.items():
        engine = LLMEngine(model, smollm.tokenizer, EngineConfig.from_options(**options), "cpu", torch.float32)
        tokens[mode] = _greedy_tokens(engine, prompts, max_tokens=24)
        stats[mode] = engine.scheduler.stats()
    assert stats["recompute"].num_preemptions > 0 and stats["swap"].num_swaps_out > 0
    assert stats["swap"].num_preemptions == 0 and stats["none"].num_preemptions == 0
    assert tokens["swap"] == tokens["none"] == tokens["recompute"]
