"""Scheduler: chunked prefill, budget sharing, preemption, prefix hits, aborts, errors and stop conditions,
driven by a fake runner that simulates the paged KV cache and checks every slot it reads."""

import random

import pytest

from leanlm.config import EngineConfig
from leanlm.engine.block_pool import BlockPool
from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.outputs import ModelRunnerOutput
from leanlm.engine.request import Request, RequestStatus
from leanlm.engine.scheduler import Scheduler
from leanlm.sampling_params import SamplingParams

VOCAB = 1000


class FakeRunner:
    """Writes each scheduled token id into a simulated KV store, then checks that every position a request
    attends to holds its token (catching wrong prefix hits, bad block tables and overwritten blocks).
    Samples (last token + 1) % VOCAB when a chunk reaches the request's last token."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.slots = {}  # (block_id, offset) -> token id
        self.host_slots = {}  # (host block id, offset) -> token id: the swap space

    def _move(self, src, dst, src_block, dst_block):
        for offset in range(self.block_size):
            if (src_block, offset) in src:
                dst[(dst_block, offset)] = src[(src_block, offset)]
            else:
                dst.pop((dst_block, offset), None)

    def _slot(self, block_ids, pos):
        return block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, out):
        batch = list(zip(out.scheduled_requests, out.num_scheduled_tokens, out.block_ids))
        for device, host in out.blocks_to_swap_out:  # like the real runner: swaps out, swaps in, then copies
            self._move(self.slots, self.host_slots, device, host)
        for host, device in out.blocks_to_swap_in:
            self._move(self.host_slots, self.slots, host, device)
        for src, dst in out.blocks_to_copy:  # copy-on-write, before any write
            for offset in range(self.block_size):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
                else:
                    self.slots.pop((dst, offset), None)
        # Like the real runner: every scheduled token's KV is written before any attention reads.
        for req, num, block_ids in batch:
            assert len(block_ids) * self.block_size >= req.num_computed_tokens + num
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + num):
                self.slots[self._slot(block_ids, pos)] = req.all_token_ids[pos]
        sampled, logprobs, prompt_logprobs = [], [], []
        for req, num, block_ids in batch:
            start, end = req.num_computed_tokens, req.num_computed_tokens + num
            for pos in range(end):
                assert self.slots[self._slot(block_ids, pos)] == req.all_token_ids[pos], (req, pos)
            tokens = [(req.all_token_ids[-1] + 1) % VOCAB] if end == req.num_tokens else []
            sampled.append(tokens)
            logprobs.append([{t: -0.5} for t in tokens] if req.sampling_params.logprobs is not None else None)
            prompt_logprobs.append(self._prompt_logprobs(req, start, end))
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(req, start, end):
        if req.sampling_params.prompt_logprobs is None:
            return None
        # The real runner's contract: entry j scores prompt token j from position j-1 (entry 0 is None),
        # and only entries not recorded yet are emitted, contiguous from len(req.prompt_logprobs).
        indices = ([0] if start == 0 else []) + list(range(start + 1, min(end, req.num_prompt_tokens - 1) + 1))
        entries = [
            None if j == 0 else {req.prompt_token_ids[j]: -float(j)} for j in indices if j >= len(req.prompt_logprobs)
        ]
        return entries or None


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=1000,
    eos_token_ids=(),
    stop_checker=None,
    enable_prefix_caching=True,
):
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
    )
    kv = KVCacheManager(BlockPool(num_blocks, enable_prefix_caching), block_size)
    return Scheduler(config, kv, max_model_len, eos_token_ids, stop_checker)


def make_request(request_id, token_ids, **params):
    return Request(request_id, list(token_ids), SamplingParams(**params))


def step(sched, runner):
    """One engine step; returns (what was scheduled as [(id, num)], the SchedulerOutput, update's result)."""
    out = sched.schedule()
    changed = sched.update(out, runner.execute(out))
    trace = [(r.request_id, n) for r, n in zip(out.scheduled_requests, out.num_scheduled_tokens)]
    return trace, out, changed


def run(sched, runner, max_steps=1000):
    traces = []
    while sched.has_unfinished_requests():
        assert len(traces) < max_steps, "the scheduler stopped making progress"
        traces.append(step(sched, runner)[0])
    return traces


def assert_all_blocks_free(sched):
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert sched.kv_cache_manager._req_to_blocks == {}


def expected_outputs(prompt, num):
    return [(prompt[-1] + i) % VOCAB for i in range(1, num + 1)]


# ---- the scheduling rule -------------------------------------------------------------------------------


def test_chunked_prefill_then_decode():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    req = make_request("a", range(20), max_tokens=3)
    sched.add_request(req)
    assert run(sched, runner) == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)], [("a", 1)]]
    assert req.output_token_ids == [20, 21, 22]
    assert req.status == RequestStatus.FINISHED_LENGTH and req.stop_reason is None
    assert req.first_scheduled_time is not None and req.first_token_time <= req.last_token_time
    assert req.finished_time is not None
    assert_all_blocks_free(sched)


def test_partial_prefill_reports_no_tokens():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", range(20), max_tokens=3))
    trace, out, changed = step(sched, runner)
    assert trace == [("a", 8)] and changed == [] and out.block_ids == [[0, 1]]


def test_running_decodes_come_first_and_waiting_prefill_gets_the_rest():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    a = make_request("a", range(4), max_tokens=6)
    b = make_request("b", range(100, 120), max_tokens=2)
    sched.add_request(a)
    assert step(sched, runner)[0] == [("a", 4)]
    sched.add_request(b)
    assert run(sched, runner) == [
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 7)],
        [("a", 1), ("b", 6)],
        [("a", 1), ("b", 1)],
        [("a", 1)],
    ]
    assert a.output_token_ids == expected_outputs(range(4), 6)
    assert b.output_token_ids == [120, 121]
    assert_all_blocks_free(sched)


def test_budget_limits_running_requests_too():
    sched = make_scheduler(max_num_batched_tokens=2)
    runner = FakeRunner(4)
    for name in "abc":
        sched.add_request(make_request(name, [1], max_tokens=2))
    traces = run(sched, runner)
    assert traces == [[("a", 1), ("b", 1)], [("a", 1), ("b", 1)], [("c", 1)], [("c", 1)]]
    assert_all_blocks_free(sched)


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    for name, max_tokens in zip("abc", (1, 3, 1)):
        sched.add_request(make_request(name, [1, 2], max_tokens=max_tokens))
    trace, _, changed = step(sched, runner)
    assert trace == [("a", 2), ("b", 2)] and [r.request_id for r in changed] == ["a", "b"]
    assert sched.num_running == 1 and sched.num_waiting == 1  # a finished; c is admitted next step
    assert run(sched, runner) == [[("b", 1), ("c", 2)], [("b", 1)]]
    assert_all_blocks_free(sched)


# ---- prefix caching ------------------------------------------------------------------------------------


def test_prefix_hit_across_steps_and_in_the_same_step():
    sched = make_scheduler()
    runner = FakeRunner(4)
    a = make_request("a", range(10), max_tokens=2)
    b = make_request("b", range(10), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    _, out, _ = step(sched, runner)
    # b hits a's two full blocks registered moments earlier: their KV is written in this very step.
    assert out.num_scheduled_tokens == [10, 2] and out.block_ids == [[0, 1, 2], [0, 1, 3]]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert [blk.ref_cnt for blk in sched.kv_cache_manager.block_pool.blocks[:4]] == [2, 2, 1, 1]
    c = make_request("c", range(10), max_tokens=2)
    sched.add_request(c)
    _, out, _ = step(sched, runner)
    assert out.block_ids[2] == [0, 1, 4] and c.num_cached_tokens == 8
    run(sched, runner)
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids == [10, 11]
    assert_all_blocks_free(sched)


def test_prefix_hit_on_freed_blocks_after_finish():
    sched = make_scheduler(num_blocks=8)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", range(8), max_tokens=1))
    run(sched, runner)
    b = make_request("b", range(9), max_tokens=1)  # a's prompt plus its output token 8
    sched.add_request(b)
    _, out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == [1] and out.block_ids == [[0, 1, 2]] and b.num_cached_tokens == 8
    assert b.output_token_ids == [9]
    assert sched.stats().prefix_cache_hit_rate == 8 / 17


# ---- preemption ----------------------------------------------------------------------------------------


def test_preempt_newest_running_then_resume_and_finish():
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", range(8), max_tokens=4)
    b = make_request("b", range(100, 103), max_tokens=3)
    c = make_request("c", range(200, 203), max_tokens=3)
    for req in (a, b, c):
        sched.add_request(req)
    kv = sched.kv_cache_manager
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 8), ("b", 3), ("c", 3)] and out.block_ids == [[0, 1], [2], [3]]
    # a needs a third block: c, the newest, is preempted and its block 3 goes to a.
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 1), ("b", 1)] and out.preempted_request_ids == ["c"]
    assert out.block_ids == [[0, 1, 3], [2]]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and kv.get_block_ids("c") == []
    # b needs a second block and is now the newest running: it preempts itself and is skipped.
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 1)] and out.preempted_request_ids == ["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    # No preemption this step, but b's two blocks (one a cache hit) do not fit yet: it stays waiting.
    trace, out, _ = step(sched, runner)
    assert trace == [("a", 1)] and a.is_finished and sched.num_waiting == 2
    # a is done: b resumes on its cached first block and recomputes one token; c recomputes all 4.
    trace, out, _ = step(sched, runner)
    assert trace == [("b", 1), ("c", 4)] and out.block_ids == [[2, 3], [1]]
    assert run(sched, runner) == [[("c", 1)]]
    assert a.output_token_ids == [8, 9, 10, 11]
    assert b.output_token_ids == [103, 104, 105] and c.output_token_ids == [203, 204, 205]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert b.num_cached_tokens == 0  # set when first scheduled, not on resume
    stats = sched.stats()
    assert stats.num_preemptions == 2 and stats.num_finished == {"length": 3}
    assert stats.prefix_cache_hit_rate == 4 / 23  # admissions: a 8, b 3, c 3, then b 5 (4 hit), c 4
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert_all_blocks_free(sched)


def test_preempted_request_does_not_duplicate_prompt_logprobs():
    sched = make_scheduler(num_blocks=3, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", range(8), max_tokens=4)
    b = make_request("b", range(100, 103), max_tokens=3, prompt_logprobs=0, logprobs=0)
    sched.add_request(a)
    sched.add_request(b)
    traces = run(sched, runner)
    assert traces[:2] == [[("a", 8), ("b", 3)], [("a", 1)]]
    assert b.num_preemptions == 1
    assert b.prompt_logprobs == [None, {101: -1.0}, {102: -2.0}]
    assert b.output_token_ids == [103, 104, 105]
    assert b.output_logprobs == [{103: -0.5}, {104: -0.5}, {105: -0.5}]
    assert_all_blocks_free(sched)


# ---- aborts and errors ---------------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_blocks():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    runner = FakeRunner(4)
    a = make_request("a", range(10), max_tokens=5)
    b = make_request("b", range(10), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 5
    assert sched.abort_request("a") is a and sched.abort_request("b") is b
    assert sched.abort_request("a") is None and sched.abort_request("nope") is None
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert_all_blocks_free(sched)
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == ["a", "b"]
    assert sched.schedule().finished_request_ids == []
    assert sched.stats().num_finished == {"abort": 2}


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = make_scheduler()
    runner = FakeRunner(4)
    a = make_request("a", range(5), max_tokens=5)
    sched.add_request(a)
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.abort_request("a")
    assert sched.update(out, runner_out) == []
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert_all_blocks_free(sched)


def test_finish_with_error():
    sched = make_scheduler()
    runner = FakeRunner(4)
    a = make_request("a", range(5), max_tokens=5)
    sched.add_request(a)
    step(sched, runner)
    assert sched.finish_with_error("a", "NaN in logits") is a
    assert a.status == RequestStatus.FINISHED_ERROR and a.error == "NaN in logits"
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("max_num_batched_tokens", [64, 8])
def test_prompt_larger_than_the_pool_errors_instead_of_hanging(max_num_batched_tokens):
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=max_num_batched_tokens)
    runner = FakeRunner(4)
    big = make_request("big", range(17), max_tokens=2)
    small = make_request("small", range(3), max_tokens=2)
    sched.add_request(big)
    sched.add_request(small)
    trace, out, changed = step(sched, runner)
    assert trace == [("small", 3)] and out.finished_request_ids == ["big"]
    assert changed == [big, small]
    assert big.status == RequestStatus.FINISHED_ERROR
    assert "needs 5 KV blocks for 17 tokens but the pool has only 4 blocks" in big.error
    run(sched, runner)
    assert small.output_token_ids == [3, 4]
    assert_all_blocks_free(sched)


def test_generation_outgrowing_the_pool_errors_instead_of_looping():
    sched = make_scheduler(num_blocks=4, block_size=4)
    runner = FakeRunner(4)
    req = make_request("a", range(15), max_tokens=5)
    sched.add_request(req)
    traces = run(sched, runner)
    assert traces == [[("a", 15)], [("a", 1)], [], []]  # self-preempted, then failed on re-admission
    assert req.status == RequestStatus.FINISHED_ERROR and req.num_preemptions == 1
    assert "needs 5 KV blocks for 17 tokens" in req.error
    assert req.output_token_ids == [15, 16]
    assert_all_blocks_free(sched)


def test_keeps_kv_request_holds_its_blocks_until_released():
    sched = make_scheduler()
    runner = FakeRunner(4)
    req = Request("a", list(range(6)), SamplingParams(max_tokens=1), keeps_kv=True)
    sched.add_request(req)
    run(sched, runner)
    assert req.status == RequestStatus.FINISHED_LENGTH and not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_block_ids("a") == [0, 1] and sched.shared.is_held("a")
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(make_request("a", [1]))
    assert sched.release_kv("a") and not sched.release_kv("a")
    assert_all_blocks_free(sched)


def test_aborted_keeps_kv_request_frees_at_once():
    sched = make_scheduler()
    runner = FakeRunner(4)
    sched.add_request(Request("a", list(range(6)), SamplingParams(max_tokens=5), keeps_kv=True))
    step(sched, runner)
    sched.abort_request("a")
    assert sched.shared.held == {}
    assert_all_blocks_free(sched)


def test_forks_share_the_parent_kv_and_copy_its_last_block():
    """Two forks of a finished parent, each with its own next token: the fake runner checks every slot they
    read, so a missing or wrong copy, or a write into the shared block, fails."""
    sched = make_scheduler()
    runner = FakeRunner(4)
    parent = Request("p", list(range(6)), SamplingParams(max_tokens=1), keeps_kv=True)
    sched.add_request(parent)
    run(sched, runner)
    children = []
    for child_id, token in (("c0", 500), ("c1", 600)):
        child = make_request(child_id, parent.all_token_ids[:6], max_tokens=3)
        child.append_output_token_ids(token)
        sched.fork_request(parent, child, 6)
        children.append(child)
    assert sched.release_kv("p")
    trace, out, _ = step(sched, runner)
    assert trace == [("c0", 1), ("c1", 1)]
    assert out.block_ids == [[0, 2], [0, 1]] and out.blocks_to_copy == [(1, 2)]
    run(sched, runner)
    assert [c.output_token_ids for c in children] == [[500, 501, 502], [600, 601, 602]]
    assert_all_blocks_free(sched)


def test_held_blocks_are_evicted_before_running_requests_are_preempted():
    sched = make_scheduler(num_blocks=4)
    runner = FakeRunner(4)
    parent = Request("p", list(range(6)), SamplingParams(max_tokens=1), keeps_kv=True)
    sched.add_request(parent)
    run(sched, runner)  # p holds blocks 0 and 1 (block 0 cached)
    other = make_request("o", range(100, 111), max_tokens=2)  # 11 tokens: 3 blocks, only 2 free
    sched.add_request(other)
    trace, out, _ = step(sched, runner)
    assert trace == [("o", 11)] and out.preempted_request_ids == [] and sched.num_preemptions == 1
    assert parent.num_computed_tokens == 0 and sched.kv_cache_manager.get_block_ids("p") == []
    # A fork of the evicted parent recomputes from the queue's head, reviving p's cached block 0.
    child = make_request("c", range(6), max_tokens=2)
    child.append_output_token_ids(500)
    sched.fork_request(parent, child, 6)  # the evicted parent has none of them left
    assert sched.waiting[0] is child
    assert sched.release_kv("p")
    run(sched, runner)
    assert child.output_token_ids == [500, 501] and child.num_cached_tokens == 4
    assert_all_blocks_free(sched)


def test_fork_refuses_a_parent_without_kv():
    sched = make_scheduler()
    parent = make_request("p", range(6), max_tokens=1)
    sched.add_request(parent)  # waiting: no blocks yet
    child = make_request("c", range(6))
    with pytest.raises(ValueError, match="holds no KV to fork"):
        sched.fork_request(parent, child, 5)


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(make_request("a", [2]))
    sched.abort_request("a")
    sched.add_request(make_request("a", [3]))  # a finished id may be used again


# ---- stop conditions -----------------------------------------------------------------------------------


def generate(prompt, eos_token_ids=(), max_model_len=1000, stop_checker=None, **params):
    sched = make_scheduler(eos_token_ids=eos_token_ids, max_model_len=max_model_len, stop_checker=stop_checker)
    req = make_request("r", prompt, **params)
    sched.add_request(req)
    run(sched, FakeRunner(4))
    assert_all_blocks_free(sched)
    return req


@pytest.mark.parametrize(
    "kwargs, outputs, status, stop_reason",
    [
        (dict(eos_token_ids=(7,)), [6, 7], RequestStatus.FINISHED_STOPPED, None),
        (dict(eos_token_ids=(7,), ignore_eos=True, max_tokens=4), [6, 7, 8, 9], RequestStatus.FINISHED_LENGTH, None),
        (dict(eos_token_ids=(6, 8), min_tokens=3), [6, 7, 8], RequestStatus.FINISHED_STOPPED, None),
        (dict(stop_token_ids=(8,)), [6, 7, 8], RequestStatus.FINISHED_STOPPED, 8),
        (dict(stop_token_ids=(7,), min_tokens=3, max_tokens=4), [6, 7, 8, 9], RequestStatus.FINISHED_LENGTH, None),
        (dict(max_tokens=3), [6, 7, 8], RequestStatus.FINISHED_LENGTH, None),
        (dict(max_model_len=8, max_tokens=10), [6, 7, 8], RequestStatus.FINISHED_LENGTH, None),
        (
            dict(stop_checker=lambda r: "seven" if r.output_token_ids[-1] == 7 else None),
            [6, 7],
            RequestStatus.FINISHED_STOPPED,
            "seven",
        ),
        (dict(eos_token_ids=(9,), max_tokens=4), [6, 7, 8, 9], RequestStatus.FINISHED_STOPPED, None),
    ],
)
def test_stop_conditions(kwargs, outputs, status, stop_reason):
    req = generate([1, 2, 3, 4, 5], **kwargs)
    assert req.output_token_ids == outputs
    assert req.status == status and req.stop_reason == stop_reason


def test_stop_checker_waits_for_min_tokens():
    req = generate([5], stop_checker=lambda r: "x", min_tokens=2, max_tokens=5)
    assert req.output_token_ids == [6, 7] and req.stop_reason == "x"


# ---- everything at once ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_runs_to_completion(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    runner = FakeRunner(4)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    pending = []
    for idx in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
        pending.append(make_request(f"r{idx}", prompt, max_tokens=rng.randrange(1, 16)))
    requests = list(pending)
    aborted = set()
    for step_idx in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if step_idx % 17 == 5 and sched.running:
            aborted.add(sched.abort_request(rng.choice(sched.running).request_id).request_id)
        step(sched, runner)
        if not pending and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    for req in requests:
        if req.request_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
        elif req.num_prompt_tokens + req.sampling_params.max_tokens > 48:
            assert req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ERROR)
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert req.output_token_ids == expected_outputs(req.prompt_token_ids, req.sampling_params.max_tokens)
    stats = sched.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert_all_blocks_free(sched)
