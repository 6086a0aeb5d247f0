"""StepPlan: one step's forward, as every process that runs a part of the model needs it (token ids, positions,
the attention entries, the copy-on-write copies and which rows need logits), planned from a SchedulerOutput.

It holds no Request: it is what the scheduler's process broadcasts to the other ranks of a tensor- or
pipeline-parallel model (leanlm.parallel), and what the local runner forwards too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from leanlm.engine.outputs import SchedulerOutput
from leanlm.engine.request import Request
from leanlm.model.lora import LoRARun


@dataclass(frozen=True)
class PromptRows:
    """The prompt logprob entries [first_entry, last_entry] one request records this step: entry j scores prompt
    token j from the hidden row of position j-1; `with_first` adds entry 0 (None: nothing precedes it)."""

    first_entry: int
    last_entry: int  # inclusive; < first_entry when no entry is due
    with_first: bool

    @property
    def num_rows(self) -> int:
        return max(0, self.last_entry - self.first_entry + 1)


@dataclass(frozen=True)
class StepPlan:
    """The forward of one step. Tensors live on the runner's device (other ranks get them as bytes: parallel/wire.py,
    which has a rule for every field)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    query_lens: list[int]  # per attention entry (a draft-verifying request has one entry per token)
    seq_lens: list[int]  # per attention entry: tokens with KV after its rows
    block_ids: list[list[int]]  # per attention entry: its KV block ids
    blocks_to_copy: list[tuple[int, int]]  # (src, dst) copy-on-write copies, done before the forward writes
    # swap preemption's copies (device block, host block) out and (host, device) in, done before the copies above
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    logit_rows: torch.Tensor  # [R] long: hidden rows whose logits the step needs, sample rows first, then prompt rows
    num_sample_rows: int  # the first rows of logit_rows: each sampling request's last row (and its drafts' rows)
    # static task routing: (first row, end row, experts) of each request that pins an MoE model's expert subset
    expert_subsets: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    # embedding requests: (first row, end row) of the final hidden rows each pools this step, summed (mean pooling)
    # or the one last row (last-token pooling); StepOutput.pooled has one row per segment, in this order
    pool_segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # LoRA: rows of each request that runs an adapter, with its slot (leanlm.engine.lora_manager); empty: base only
    lora_runs: tuple[LoRARun, ...] = ()

    def expert_mask(self, num_experts: int) -> torch.Tensor:
        """[T, E] bool: the experts each row may use (all, but in the pinned requests' rows)."""
        mask = torch.ones(self.num_tokens, num_experts, dtype=torch.bool, device=self.input_ids.device)
        for start, end, experts in self.expert_subsets:
            mask[start:end] = False
            mask[start:end, list(experts)] = True
        return mask

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def copies_only(cls, so: SchedulerOutput, device: torch.device) -> StepPlan:
        """A step that runs no token but must still move KV blocks (everything it scheduled was preempted)."""
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return cls(empty, empty, [], [], [], list(so.blocks_to_copy), list(so.blocks_to_swap_out),
                   list(so.blocks_to_swap_in), empty, 0)  # fmt: skip


@dataclass(frozen=True)
class PlannedStep:
    """A StepPlan and what only the scheduler's process reads back from its logits."""

    plan: StepPlan
    sample_rows: list[int]  # requests whose chunk ends at their last token: they sample
    prompt_rows: list[PromptRows | None]  # per request: its prompt logprob entries (None: prompt_logprobs off)
    pool_requests: list[int] = dataclasses.field(default_factory=list)  # requests behind plan.pool_segments, in order


@dataclass(frozen=True)
class StepOutput:
    """What one plan's forward gives back to the scheduler's process."""

    logits: torch.Tensor  # [R, V] of plan.logit_rows, in the model's dtype
    pooled: torch.Tensor | None = None  # [P, hidden] float32: per plan.pool_segments, its rows' sum; None: none

    @classmethod
    def of(cls, logits: torch.Tensor, hidden: torch.Tensor, plan: StepPlan) -> StepOutput:
        """The logits, and the pooled rows of the final (normed) hidden states [T, hidden] the plan asks for."""
        if not plan.pool_segments:
            return cls(logits)
        pooled = torch.stack([hidden[start:end].float().sum(dim=0) for start, end in plan.pool_segments])
        return cls(logits, pooled)


# Output tokens with missing KV (jump-forward's forced run) up to this many enter attention as decode entries.
MAX_DECODE_RUN_TOKENS = 32


def plan_step(so: SchedulerOutput, device: torch.device) -> PlannedStep:
    """Lay the scheduled requests out as one flat batch, in order."""
    ids: list[int] = []
    positions: list[int] = []
    seq_lens, sample_rows, sample_idx, prompt_idx, prompt_rows, subsets = [], [], [], [], [], []
    pool_segments, pool_requests = [], []
    for i, (req, n) in enumerate(zip(so.scheduled_requests, so.num_scheduled_tokens)):
        row_start = len(ids)
        start = req.num_computed_tokens
        num_drafts = so.num_spec_tokens(i)
        ids.extend(req.all_token_ids[start : start + n - num_drafts])
        if num_drafts:
            ids.extend(so.spec_token_ids[i])  # drafts follow the last real token
        positions.extend(range(start, start + n))
        seq_lens.append(start - req.num_evicted_tokens + n)  # KV slots: past an eviction, fewer than positions
        if req.is_embedding:
            segment = _pool_segment(req, start, n)
            if segment is not None:
                pool_segments.append((row_start + segment[0], row_start + segment[1]))
                pool_requests.append(i)
        elif start + n - num_drafts == req.num_tokens:
            sample_rows.append(i)
            sample_idx.extend(range(len(ids) - 1 - num_drafts, len(ids)))
        if req.sampling_params.experts is not None:
            subsets.append((row_start, len(ids), req.sampling_params.experts))
        rows = _prompt_rows(req, n)
        prompt_rows.append(rows)
        if rows is not None:  # entry j comes from position j-1 of this chunk
            prompt_idx.extend(range(row_start + rows.first_entry - 1 - start, row_start + rows.last_entry - start))
    as_long = dict(dtype=torch.long, device=device)
    query_lens, entry_seq_lens, block_ids = _attention_entries(so, seq_lens, _decode_runs(so))
    plan = StepPlan(
        input_ids=torch.tensor(ids, **as_long),
        positions=torch.tensor(positions, **as_long),
        query_lens=query_lens,
        seq_lens=entry_seq_lens,
        block_ids=block_ids,
        blocks_to_copy=list(so.blocks_to_copy),
        blocks_to_swap_out=list(so.blocks_to_swap_out),
        blocks_to_swap_in=list(so.blocks_to_swap_in),
        logit_rows=torch.tensor(sample_idx + prompt_idx, **as_long),
        num_sample_rows=len(sample_idx),
        expert_subsets=subsets,
        pool_segments=pool_segments,
    )
    return PlannedStep(plan, sample_rows, prompt_rows, pool_requests)


def _pool_segment(req: Request, start: int, num_new: int) -> tuple[int, int] | None:
    """The rows (relative to the chunk) an embedding request pools from its chunk [start, start + num_new): every
    row for mean pooling, the prompt's last row for last-token pooling (None before the chunk that holds it)."""
    if req.pooling_params.pooling == "mean":
        return 0, num_new
    if start + num_new < req.num_prompt_tokens:
        return None
    return num_new - 1, num_new


def split_microbatches(so: SchedulerOutput, num_parts: int) -> list[SchedulerOutput]:
    """`so` as up to `num_parts` outputs of consecutive requests with about equal token counts (a pipeline's
    micro-batches); the block copies and swaps and the finished ids go with the first. One part: `so` itself."""
    num_parts = min(num_parts, len(so.scheduled_requests))
    if num_parts <= 1:
        return [so]
    total = so.total_num_scheduled_tokens
    bounds, running = [0], 0
    for i, n in enumerate(so.num_scheduled_tokens):
        running += n
        # close a part once it holds its share, leaving at least one request for each part still to come
        if len(bounds) < num_parts and running * num_parts >= total * len(bounds):
            if len(so.scheduled_requests) - (i + 1) >= num_parts - len(bounds):
                bounds.append(i + 1)
    bounds.append(len(so.scheduled_requests))
    parts = []
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if lo == hi:
            continue
        parts.append(
            SchedulerOutput(
                so.scheduled_requests[lo:hi],
                so.num_scheduled_tokens[lo:hi],
                so.block_ids[lo:hi],
                spec_token_ids=so.spec_token_ids[lo:hi] if so.spec_token_ids else [],
                finished_request_ids=so.finished_request_ids if k == 0 else [],
                blocks_to_copy=so.blocks_to_copy if k == 0 else [],
                blocks_to_swap_out=so.blocks_to_swap_out if k == 0 else [],
                blocks_to_swap_in=so.blocks_to_swap_in if k == 0 else [],
            )
        )
    return parts


def _prompt_rows(req: Request, num_new: int) -> PromptRows | None:
    """Entries for prompt indices not yet recorded (a preempted request recomputes its prompt) whose scoring
    position lies in this chunk [start, start + num_new); None when the request asks no prompt logprobs."""
    if req.sampling_params.prompt_logprobs is None:
        return None
    start = req.num_computed_tokens
    first_entry = len(req.prompt_logprobs)  # next prompt index to record
    last_entry = min(start + num_new, req.num_prompt_tokens - 1)  # positions < P-1 score a prompt token
    with_first = first_entry == 0 and start == 0
    first_entry = max(first_entry, 1, start + 1)
    return PromptRows(first_entry, last_entry, with_first)


def _decode_runs(so: SchedulerOutput) -> list[bool]:
    """Per request: does its chunk enter attention as one decode entry per token? A request verifying drafts does, and
    so does a short run of output tokens whose KV is missing (jump-forward's forced tokens after the sampled one): on
    CPU a multi-token chunk leaves the one-token decode path and cost 4-6 decode steps (docs/structured_output.md)."""
    return [
        bool(so.num_spec_tokens(i))
        or (1 < n <= MAX_DECODE_RUN_TOKENS and req.num_computed_tokens >= req.num_prompt_tokens)
        for i, (req, n) in enumerate(zip(so.scheduled_requests, so.num_scheduled_tokens))
    ]


def _attention_entries(
    so: SchedulerOutput, seq_lens: list[int], decode_runs: list[bool]
) -> tuple[list[int], list[int], list[list[int]]]:
    """(query_lens, seq_lens, block_ids) for the forward context. A request in `decode_runs` enters as one decode
    entry per token (token j sees the cache up to itself): the same causal attention as a chunk, but every row is
    computed exactly as a plain decode step computes it, so greedy speculation reproduces plain greedy decoding token
    for token, and the batch can stay on the decode kernels."""
    if not any(decode_runs):
        return list(so.num_scheduled_tokens), seq_lens, list(so.block_ids)
    query_lens, entry_seq_lens, block_ids = [], [], []
    for i, (n, seq_len, blocks) in enumerate(zip(so.num_scheduled_tokens, seq_lens, so.block_ids)):
        if decode_runs[i]:
            query_lens += [1] * n
            entry_seq_lens += range(seq_len - n + 1, seq_len + 1)
            block_ids += [blocks] * n
        else:
            query_lens.append(n)
            entry_seq_lens.append(seq_len)
            block_ids.append(blocks)
    return query_lens, entry_seq_lens, block_ids
