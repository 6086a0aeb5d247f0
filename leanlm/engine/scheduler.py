"""Scheduler: vLLM v1's single rule. Each step hands a token budget to running requests first, then to waiting ones
after a prefix-cache lookup; chunked prefill and decode are the same case with different counts. When blocks run out,
the newest running request is preempted: swapped out to host memory (Swapper) or recomputed later, whichever is
estimated cheaper (EngineConfig.preemption_mode). The scheduler is the only writer of Request.num_computed_tokens.
Shared KV (held blocks, sampling groups) is its collaborator SharedKV; whether a request stops is check_stop's call."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable

from leanlm.config import EngineConfig
from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.outputs import ModelRunnerOutput, SchedulerOutput, SchedulerStats
from leanlm.engine.pooling import add_chunk
from leanlm.engine.preemption import Swapper
from leanlm.engine.request import Request, RequestStatus
from leanlm.engine.shared_kv import SharedKV
from leanlm.engine.stop_check import StopChecker, append_tokens
from leanlm.lora_request import admits_adapter


class Scheduler:
    """Owns the waiting queue and the running list (and, through its Swapper, the swapped queue). Invariants: every
    unfinished request is in exactly one of them; only running requests hold KV blocks (and swapped ones the shared
    blocks they kept); running keeps admission order (newest last)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        stop_checker: StopChecker | None = None,
        swapper: Swapper | None = None,  # swap preemption over the same KVCacheManager; None: recompute only
    ) -> None:
        self.config = engine_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_checker = stop_checker
        spec = engine_config.speculative
        # Model drafts write KV for up to k tokens past a request's last one: reserve those slots with each step.
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec is not None and spec.uses_model else 0
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # finished since the last schedule(), for the runner
        self._finished_in_schedule: list[Request] = []  # failed outside update(); the next update() reports them
        # Held blocks of finished keeps_kv requests (for fork_request) and sampling siblings waiting to fork;
        # the siblings are in self.requests but in no queue.
        self.shared = SharedKV(kv_cache_manager)
        self.num_preemptions = 0
        self.swapper = swapper
        self.num_finished: Counter[str] = Counter()

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapper.swapped) if self.swapper is not None else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_hit_rate=self.kv_cache_manager.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
            num_swapped=self.num_swapped,
            num_swaps_out=self.swapper.num_swaps_out if self.swapper is not None else 0,
            num_swaps_in=self.swapper.num_swaps_in if self.swapper is not None else 0,
            num_finished=dict(self.num_finished),
        )

    # ---- requests in and out -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or self.shared.is_held(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in the engine; use a unique id")
        if request.is_finished:
            raise ValueError(f"request {request.request_id!r} is already finished ({request.status.name})")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Cancel a waiting or running request and free its blocks; None if it is unknown or finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_with_error(self, request_id: str, message: str) -> Request | None:
        """Fail one request alone (FINISHED_ERROR with `message`); the next update() reports it. Blocks it
        allocated for tokens not yet computed leave the prefix cache: their KV may never have been written.
        None if the request is unknown or finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self.kv_cache_manager.uncache_uncomputed(request)
            self._fail_in_schedule(request, message)
        return request

    def add_sampling_group(self, first: Request, siblings: list[Request]) -> None:
        """n samples of one prompt that share its KV: `first` computes the prompt; each sibling then forks the
        blocks of all but the prompt's last token (copy-on-write), computes that token itself and samples its
        own first token from it. Should `first` finish before that, the siblings run on their own."""
        for sibling in siblings:  # every check before anything is queued: a refused group leaves no trace
            if sibling.prompt_token_ids != first.prompt_token_ids:
                raise ValueError("a sampling group shares one prompt")
            if sibling.request_id in self.requests or sibling.request_id == first.request_id:
                raise ValueError(f"request id {sibling.request_id!r} is already in the engine; use a unique id")
        self.add_request(first)
        self.shared.add_siblings(first, siblings)
        for sibling in siblings:
            self.requests[sibling.request_id] = sibling

    def _fork_siblings(self, parent: Request) -> None:
        """Start the siblings waiting on `parent` now that its prompt (but the last token) has KV."""
        for sibling in self.shared.take_siblings(parent):
            del self.requests[sibling.request_id]  # fork_request admits it again
            self.fork_request(parent, sibling, sibling.num_prompt_tokens - 1)

    def _release_siblings(self, parent: Request) -> None:
        """`parent` ended before its siblings could fork: they compute the prompt themselves."""
        for sibling in self.shared.take_siblings(parent):
            self.waiting.appendleft(sibling)

    def fork_request(self, parent: Request, child: Request, num_computed_tokens: int) -> None:
        """Start `child` running on the KV `parent` computed for child's first `num_computed_tokens` tokens, shared
        copy-on-write (KVCacheManager.fork). `parent` is running, or finished and held (keeps_kv). A fork runs at
        once, even past max_num_seqs: its blocks are already taken. When the held parent's blocks were evicted
        (its num_computed_tokens is 0) the child waits at the queue's head and recomputes instead."""
        if child.request_id in self.requests or self.shared.is_held(child.request_id):
            raise ValueError(f"request id {child.request_id!r} is already in the engine; use a unique id")
        if child.is_finished:
            raise ValueError(f"request {child.request_id!r} is already finished ({child.status.name})")
        self.shared.check_fork(parent, child, num_computed_tokens)
        self.requests[child.request_id] = child
        if parent.num_computed_tokens == 0 or num_computed_tokens == 0:
            # Nothing to share (the parent's blocks were evicted): it recomputes, like a preempted request.
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)
            return
        child.num_computed_tokens = num_computed_tokens
        self.kv_cache_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = time.monotonic()
        self.running.append(child)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished keeps_kv request still holds. False when it holds none here."""
        return self.shared.release(request_id)

    # ---- schedule ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(scheduled_requests=[], num_scheduled_tokens=[], block_ids=[])
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # A step that preempted is short of blocks: admitting new work would only preempt again. Swapped requests
        # come back before any waiting one is admitted.
        if not output.preempted_request_ids:
            budget = self._schedule_swapped(output, budget)
            if not self.num_swapped:
                self._schedule_waiting(output, budget)
        output.finished_request_ids = self._finished_ids
        output.blocks_to_copy = self.kv_cache_manager.take_block_copies()
        output.kv_compactions = self.kv_cache_manager.take_compactions()
        if self.swapper is not None:
            output.blocks_to_swap_out, output.blocks_to_swap_in = self.swapper.take_swaps()
        self._finished_ids = []
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        """Give each running request, oldest first, the tokens it lacks, within the budget; returns what is left."""
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                idx += 1
                continue
            self.kv_cache_manager.evict_over_budget(request)  # a KV budget's eviction frees blocks first
            spec = self._schedulable_drafts(request, num_new, budget - num_new)
            block_ids = self._allocate_with_lookahead(request, num_new, spec)
            if block_ids is None:
                spec = []  # drafts never cost a preemption: retry without them
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while block_ids is None:
                if self._evict_held():  # idle KV of finished keeps_kv requests goes before running requests
                    block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
                    continue
                # The victim is the newest running request: never one already scheduled in this step,
                # since those come before `idx`.
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
                block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if block_ids is None:
                break  # the request preempted itself; it was the last running one
            output.add(request, num_new + len(spec), block_ids, spec)
            budget -= num_new + len(spec)
            idx += 1
        return budget

    def _allocate_with_lookahead(self, request: Request, num_new: int, spec: list[int]) -> list[int] | None:
        """Slots for the step's tokens and drafts, plus lookahead slots for the next drafts when the step samples;
        without the lookahead if the pool is short. None when even the drafts do not fit (nothing changed)."""
        samples = num_new == request.num_tokens - request.num_computed_tokens
        if samples and self.num_lookahead_tokens:
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new + len(spec) + self.num_lookahead_tokens)
            if block_ids is not None:
                return block_ids
        return self.kv_cache_manager.allocate_slots(request, num_new + len(spec)) if spec else None

    def _schedulable_drafts(self, request: Request, num_new: int, budget_left: int) -> list[int]:
        """The request's draft tokens that may run this step: only with its whole remainder scheduled (the
        drafts follow its last token), within the budget, and only as many as could still be kept."""
        spec = request.spec_token_ids
        request.spec_token_ids = []  # consumed: a draft is verified once
        if not spec or num_new < request.num_tokens - request.num_computed_tokens:
            return []
        return spec[: max(0, min(len(spec), request.draft_room(self.max_model_len), budget_left))]

    def _schedule_swapped(self, output: SchedulerOutput, budget: int) -> int:
        """Swap requests back in, oldest first, while their blocks and next tokens fit (none preempts in the step that
        copies its KV back); with nothing running, held KV goes, then the head recomputes. Returns the budget left."""
        kv = self.kv_cache_manager
        while self.num_swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapper.swapped[0]
            if not admits_adapter(request.lora_request, self.running, self.config.max_loras):
                break  # its adapter waits for a running one's slot
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if kv.num_blocks_to_swap_in(request, num_new) > kv.num_free_blocks:
                if self.running:
                    break  # running requests free blocks as they finish
                if not self._evict_held():
                    self.swapper.drop(request)
                    kv.free(request, keep_hashes=True)
                    self._requeue(request)
                continue
            self.swapper.swap_in(request)
            self.running.append(request)
            output.add(request, num_new, kv.allocate_slots(request, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests FIFO while the budget, max_num_seqs and the pool allow."""
        kv = self.kv_cache_manager
        held_back: list[Request] = []  # requests whose adapter waits for a slot; later ones may go first
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._fail_if_never_fits(request):
                continue
            if not admits_adapter(request.lora_request, self.running, self.config.max_loras):
                held_back.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            block_ids = kv.allocate_slots(request, num_new, hit_blocks)
            if block_ids is None:
                if self._evict_held():
                    continue  # look up again: the freed blocks may hold its prefix
                if not self.running:
                    # Nothing will ever free a block for it: fail it rather than wait forever.
                    message = kv.too_big_message(request.request_id, num_hit_tokens + num_new)
                    self._fail_in_schedule(request, message)
                    continue
                break  # FIFO: later requests wait behind the head
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.add(request, num_new, block_ids)
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))

    def _fail_if_never_fits(self, request: Request) -> bool:
        """Fail the request when its tokens need more blocks than the whole pool (it would otherwise be
        chunked in, run out of blocks, preempt itself and start over forever)."""
        if self.kv_cache_manager.peak_blocks(request.num_tokens) <= self.kv_cache_manager.block_pool.num_blocks:
            return False
        self._fail_in_schedule(request, self.kv_cache_manager.too_big_message(request.request_id, request.num_tokens))
        return True

    def _fail_in_schedule(self, request: Request, message: str) -> None:
        request.error = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._finished_in_schedule.append(request)

    def _evict_held(self) -> bool:
        """Free the blocks of the oldest held request that has any; a fork of it recomputes. False when no held
        request holds blocks."""
        request = self.shared.evict_oldest()
        if request is None:
            return False
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        return True

    def _preempt(self, request: Request) -> None:
        """Swap it out when the Swapper finds that cheaper and has room (its KV comes back as it was); otherwise drop
        its KV and put it at the front of the waiting queue, to be recomputed."""
        request.spec_token_ids = []
        if self.swapper is not None and self.swapper.swap_out(request):
            return
        self.kv_cache_manager.free(request, keep_hashes=True)
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- update --------------------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance each scheduled request by what the runner computed and sampled; finish those that hit a
        stop condition. Returns the requests that got tokens or finished (including any that failed inside
        schedule()), each once, in batch order."""
        changed = self._finished_in_schedule
        self._finished_in_schedule = []
        for idx, request in enumerate(scheduler_output.scheduled_requests):
            if request.is_finished:
                continue  # aborted between schedule() and update()
            if request.is_embedding:  # prefill only: it pools its rows, and finishes with its prompt
                if add_chunk(request, scheduler_output.num_scheduled_tokens[idx], runner_output.pooled_row(idx)):
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    changed.append(request)
                continue
            sampled = runner_output.sampled_token_ids[idx]
            num_drafts = scheduler_output.num_spec_tokens(idx)
            # Drafts the verification rejected have KV in the cache that later tokens overwrite.
            num_rejected = num_drafts - (len(sampled) - 1) if num_drafts else 0
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[idx] - num_rejected
            if (
                self.shared.has_siblings(request.request_id)
                and request.num_computed_tokens >= request.num_prompt_tokens - 1
            ):
                self._fork_siblings(request)
            request.num_draft_tokens += num_drafts
            request.num_accepted_tokens += num_drafts - num_rejected
            request.add_prompt_logprobs(*runner_output.prompt_logprobs_of(idx))
            logprobs = runner_output.logprobs[idx] if runner_output.logprobs else None
            error = runner_output.errors[idx] if runner_output.errors else None  # the step failed it alone
            status = append_tokens(
                request, sampled, logprobs, self.eos_token_ids, self.max_model_len, self.stop_checker, error
            )
            finished = status is not None
            if finished:
                self._finish(request, status)
            if not finished and runner_output.spec_token_ids is not None:
                request.spec_token_ids = runner_output.spec_token_ids[idx]
            if sampled or finished:
                changed.append(request)
        return changed

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Move an unfinished request out of the queues, free its blocks and record it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapper.drop(request)  # its kept shared blocks are freed below
        elif not self.shared.drop_sibling(request):
            self.waiting.remove(request)
        self._release_siblings(request)
        if request.keeps_kv and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.shared.hold(request)  # its blocks stay taken until release_kv
        else:
            self.kv_cache_manager.free(request)
        request.status = status
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.num_finished[status.value] += 1
