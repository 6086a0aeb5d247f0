"""Stage contracts: what the scheduler hands the model runner, what the runner hands back, and the
public per-request results (vLLM-shaped `RequestOutput` / `CompletionOutput`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from leanlm.engine.kv_budget import Compaction
from leanlm.engine.request import Request
from leanlm.sampling_params import RequestOutputKind


@dataclass
class SchedulerOutput:
    """One step's work. Parallel lists, in batch order: the runner lays tokens out in this order."""

    scheduled_requests: list[Request]  # running requests that compute tokens this step
    num_scheduled_tokens: list[int]  # per request: tokens to compute, from request.num_computed_tokens on
    block_ids: list[list[int]]  # per request: its KV block ids, covering num_computed + num_scheduled tokens
    # per request: draft tokens to verify, the last len() of its scheduled tokens (they follow all_token_ids)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)  # preempted during this schedule()
    finished_request_ids: list[str] = field(default_factory=list)  # finished since the last schedule()
    # (src, dst) KV block ids to copy before the forward: copy-on-write of blocks shared by forks
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (device, host) block ids to copy to the swap space, then (host, device) ids to copy back, before the copies
    # above and the forward: swap preemption (engine/preemption.py)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # KV budget evictions the runner carries out first of all, before the swaps and copies above
    kv_compactions: list[Compaction] = field(default_factory=list)

    def add(self, request: Request, num_new: int, block_ids: list[int], spec: list[int] | None = None) -> None:
        """Schedule `num_new` tokens of `request` (its last len(spec) the drafts to verify) over `block_ids`."""
        self.scheduled_requests.append(request)
        self.num_scheduled_tokens.append(num_new)
        self.block_ids.append(block_ids)
        self.spec_token_ids.append(spec or [])

    def num_spec_tokens(self, idx: int) -> int:
        return len(self.spec_token_ids[idx]) if self.spec_token_ids else 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_requests


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics and logs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    prefix_cache_hit_rate: float  # hit tokens / looked-up tokens, since start or the last reset
    num_preemptions: int  # recompute preemptions (KV dropped) since start
    num_swapped: int = 0  # requests swapped out to host memory now
    num_swaps_out: int = 0  # swap preemptions (KV copied to host memory) since start
    num_swaps_in: int = 0  # swapped requests brought back since start
    num_finished: dict[str, int] = field(default_factory=dict)  # finish reason ('stop', ...) -> count


@dataclass
class ModelRunnerOutput:
    """What one forward produced, parallel to SchedulerOutput.scheduled_requests."""

    # Per request: tokens sampled this step; empty when the chunk ended inside the prompt (partial prefill).
    sampled_token_ids: list[list[int]]
    # Per request: for each sampled token, {token id: logprob} with the top-k and the chosen token; or None.
    logprobs: list[list[dict[int, float]] | None]
    # Per request: for each prompt position computed this step, {token id: logprob} (None for position 0).
    prompt_logprobs: list[list[dict[int, float] | None] | None]
    # Per request, with full_prompt_logprobs: the same positions' whole log-softmax, [n, V] float32 on CPU.
    prompt_logprobs_full: list[torch.Tensor | None] | None = None
    # Per request: draft tokens proposed for the next step (speculative decoding); None when nothing proposes.
    spec_token_ids: list[list[int]] | None = None
    # per request, the pooled final hidden row(s) [hidden] float32 CPU of an embedding request's chunk (the sum of its
    # rows, or its last row); None for the others, or for all when no embedding request pooled this step
    pooled: list[torch.Tensor | None] | None = None
    # Per request: why this step failed it alone (a grammar that refused its token), or None; the scheduler finishes
    # it with FINISHED_ERROR. None when no request failed.
    errors: list[str | None] | None = None

    def prompt_logprobs_of(self, idx: int) -> tuple[list[dict[int, float] | None] | None, torch.Tensor | None]:
        """Request idx's prompt logprob entries and full log-softmax rows from this step (each None if none)."""
        full = self.prompt_logprobs_full[idx] if self.prompt_logprobs_full else None
        return (self.prompt_logprobs[idx] if self.prompt_logprobs else None), full

    def pooled_row(self, idx: int) -> torch.Tensor | None:
        return self.pooled[idx] if self.pooled else None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counts for one request."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int  # which of the n completions
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per generated token, when SamplingParams.logprobs is set
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | 'error'; None while streaming
    stop_reason: int | str | None = None  # the stop token id or string that matched
    error: str | None = None  # why it failed, when finish_reason is 'error'

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return float(sum(lp[t] for lp, t in zip(self.logprobs, self.token_ids)))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result (or, while streaming, the progress so far) of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # With full_prompt_logprobs, once finished: [P-1, V] float32 on CPU; row j-1 is the log-softmax that
    # scores prompt token j (the distribution behind prompt_logprobs[j]).
    prompt_logprobs_full: torch.Tensor | None = None
    # CUMULATIVE: outputs hold everything so far. DELTA: only what is new since the request's previous output
    # (text, token_ids and logprobs of each completion; prompt_logprobs in the first output only).
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # An embedding request's (PoolingParams), once finished: [hidden] float32 on CPU; its outputs hold one empty
    # completion that carries the finish reason.
    embedding: torch.Tensor | None = None


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive DELTA outputs of one request as one DELTA output (what a reader that fell behind gets);
    O(their size). A single output is returned as it is."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    completions = []
    for parts in zip(*(o.outputs for o in outputs), strict=True):  # one tuple per completion index
        end = parts[-1]
        logprobs = None if end.logprobs is None else [lp for c in parts for lp in c.logprobs or ()]
        completions.append(
            dataclasses.replace(
                end,
                text="".join(c.text for c in parts),
                token_ids=[t for c in parts for t in c.token_ids],
                logprobs=logprobs,
            )
        )
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return dataclasses.replace(last, outputs=completions, prompt_logprobs=prompt_logprobs)
