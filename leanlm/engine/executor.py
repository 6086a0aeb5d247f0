"""IsolatingExecutor: runs a step's batch on the model runner so that a request whose computation raises
fails alone. The batch runs as one forward; only when it raises is each request re-run by itself, in batch
order, to find the culprits."""

from __future__ import annotations

import logging

from leanlm.engine.errors import EngineDeadError
from leanlm.engine.model_runner import ModelRunner
from leanlm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from leanlm.engine.scheduler import Scheduler
from leanlm.engine.threads import ThreadSizer

logger = logging.getLogger(__name__)


class IsolatingExecutor:
    """`execute(scheduler_output)` as ModelRunner.execute, except that it does not raise for a bad request:
    the failing request is finished with FINISHED_ERROR (and reported by the next update()), and the rest
    of the batch gets its tokens as if the batch had run whole."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, threads: ThreadSizer | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.threads = threads  # sizes torch's threads before each batch (None: a parallel driver set them)
        self.num_isolations = 0  # batches that raised and were re-run request by request

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.refresh()
        try:
            return self.runner.execute(scheduler_output)
        except EngineDeadError:
            raise  # no request caused it, and re-running any would only wait on the dead rank again
        except Exception:
            if len(scheduler_output.scheduled_requests) == 0:
                raise
            logger.exception(
                "a batch of %d requests raised; re-running them one by one", len(scheduler_output.scheduled_requests)
            )
            self.num_isolations += 1
            return self._isolate(scheduler_output)

    def _isolate(self, so: SchedulerOutput) -> ModelRunnerOutput:
        num_requests = len(so.scheduled_requests)
        merged = ModelRunnerOutput(
            [[] for _ in range(num_requests)], [None] * num_requests, [None] * num_requests, [None] * num_requests
        )
        # KV blocks a failed request allocated this step may be unwritten; a later request of the same batch
        # that shares one (a same-step prefix hit) would read garbage, so it fails too.
        unwritten: set[int] = set()
        for idx, request in enumerate(so.scheduled_requests):
            if unwritten.intersection(so.block_ids[idx]):
                self.scheduler.finish_with_error(
                    request.request_id, "it shared KV blocks with a request that failed in the same step; retry it"
                )
                continue
            spec = [so.spec_token_ids[idx]] if so.spec_token_ids else []
            alone = SchedulerOutput([request], [so.num_scheduled_tokens[idx]], [so.block_ids[idx]], spec_token_ids=spec)
            try:
                # Its own copy-on-write copies (done already if the batch got that far: copies are idempotent).
                alone.blocks_to_copy = [(src, dst) for src, dst in so.blocks_to_copy if dst in so.block_ids[idx]]
                out = self.runner.execute(alone)
            except Exception as exc:
                logger.exception("request %s failed", request.request_id)
                unwritten.update(self.scheduler.kv_cache_manager.uncache_uncomputed(request))
                self.scheduler.finish_with_error(request.request_id, f"{type(exc).__name__}: {exc}")
                continue
            merged.sampled_token_ids[idx] = out.sampled_token_ids[0]
            merged.logprobs[idx] = out.logprobs[0] if out.logprobs else None
            merged.prompt_logprobs[idx] = out.prompt_logprobs[0] if out.prompt_logprobs else None
            merged.prompt_logprobs_full[idx] = out.prompt_logprobs_full[0] if out.prompt_logprobs_full else None
            if out.errors and out.errors[0] is not None:
                merged.errors = merged.errors or [None] * num_requests
                merged.errors[idx] = out.errors[0]
        return merged
