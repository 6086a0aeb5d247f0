"""leanlm.engine.step_plan: the flat batch a step's forward runs, and the micro-batches a pipeline splits it into."""

from __future__ import annotations

import torch

from leanlm.engine.outputs import SchedulerOutput
from leanlm.engine.request import Request
from leanlm.engine.step_plan import plan_step, split_microbatches
from leanlm.sampling_params import SamplingParams


def _request(rid: str, prompt_len: int, computed: int, prompt_logprobs: int | None = None) -> Request:
    req = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs))
    req.num_computed_tokens = computed
    return req


def _output(reqs: list[Request], counts: list[int]) -> SchedulerOutput:
    return SchedulerOutput(reqs, counts, [[i] for i in range(len(reqs))], blocks_to_copy=[(5, 6)])


def test_the_plan_lays_requests_out_in_order_sample_rows_first():
    a, b = _request("a", 6, 0, prompt_logprobs=1), _request("b", 4, 3)
    planned = plan_step(_output([a, b], [4, 1]), torch.device("cpu"))  # a: a prompt chunk, b: its last token
    plan = planned.plan
    assert plan.input_ids.tolist() == [10, 11, 12, 13, 13]
    assert plan.positions.tolist() == [0, 1, 2, 3, 3]
    assert (plan.query_lens, plan.seq_lens, plan.blocks_to_copy) == ([4, 1], [4, 4], [(5, 6)])
    assert planned.sample_rows == [1]  # only b reaches its last token
    # row 4 samples b; a's chunk scores prompt entries 1..4 from rows 0..3
    assert (plan.logit_rows.tolist(), plan.num_sample_rows) == ([4, 0, 1, 2, 3], 1)
    rows = planned.prompt_rows[0]
    assert (rows.first_entry, rows.last_entry, rows.with_first) == (1, 4, True)
    assert planned.prompt_rows[1] is None


def test_a_short_run_of_output_tokens_enters_as_decode_entries():
    # jump-forward appended 3 forced tokens after b's sampled one: 4 output tokens without KV, as decode entries (each
    # sees the cache up to itself), so the step stays on the one-token decode path; a prompt chunk stays one entry
    a, b = _request("a", 6, 0), _request("b", 4, 4)
    b.append_output_token_ids([50, 51, 52, 53])
    planned = plan_step(_output([a, b], [4, 4]), torch.device("cpu"))
    plan = planned.plan
    assert plan.query_lens == [4, 1, 1, 1, 1] and plan.seq_lens == [4, 5, 6, 7, 8]
    assert plan.block_ids == [[0], [1], [1], [1], [1]]
    assert planned.sample_rows == [1] and plan.logit_rows.tolist() == [7]  # b's last row samples
    recomputed = _request("c", 4, 0)  # a preempted request recomputing prompt and outputs: one chunk
    recomputed.append_output_token_ids([50, 51])
    assert plan_step(_output([recomputed], [6]), torch.device("cpu")).plan.query_lens == [6]


def test_micro_batches_split_by_tokens_and_keep_every_request_once():
    reqs = [_request(str(i), 8, 0) for i in range(5)]
    so = _output(reqs, [8, 8, 1, 1, 8])
    parts = split_microbatches(so, 2)
    assert [p.num_scheduled_tokens for p in parts] == [[8, 8], [1, 1, 8]]
    assert [r.request_id for p in parts for r in p.scheduled_requests] == ["0", "1", "2", "3", "4"]
    assert parts[0].blocks_to_copy == [(5, 6)] and parts[1].blocks_to_copy == []
    many = split_microbatches(so, 9)  # never an empty part, never more parts than requests
    assert all(p.scheduled_requests for p in many) and len(many) <= 5
    assert split_microbatches(so, 1) == [so]
