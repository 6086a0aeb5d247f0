"""RequestStream: one request's outputs, delivered by the async engine's thread, read by a coroutine."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from leanlm.engine.outputs import RequestOutput, merge_deltas
from leanlm.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from leanlm.engine.async_engine import AsyncLLMEngine


class RequestStream:
    """One request's outputs as an async iterator of RequestOutputs (the last has finished=True), of the kind
    its SamplingParams.output_kind asks for. Closing it early (or calling abort) cancels the request in the
    engine and frees its KV blocks.

    A reader that falls behind gets one output for everything it missed, never a backlog of copies: a newer
    CUMULATIVE output replaces an unread one (it holds everything the older did), and unread DELTA outputs are
    merged when read (each holds only its increment, so what waits is O(unread text)). Consumers must not assume
    one output per token.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, num_seqs: int, client: str | None = None) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs  # sequences it holds in the engine (its n)
        self.client = client  # who asked (an API key or address), for the per-client limit; None: not counted
        self._engine = engine
        # Delivered, unread: a run of DELTA outputs, or at most one non-final CUMULATIVE output, then the final one.
        self._pending: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._ready = asyncio.Event()  # set while _pending is not empty
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        last = self._pending[-1] if self._pending else None
        is_cumulative = isinstance(item, RequestOutput) and item.kind != RequestOutputKind.DELTA
        if is_cumulative and isinstance(last, RequestOutput) and not last.finished:
            self._pending[-1] = item  # the newer output holds everything the older one did
        else:
            self._pending.append(item)
        self._ready.set()

    async def _get(self) -> RequestOutput | BaseException:
        """The next item; a run of unread DELTA outputs comes as one."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        first = self._pending.popleft()
        if not isinstance(first, RequestOutput) or first.kind != RequestOutputKind.DELTA or first.finished:
            return first
        run = [first]
        while self._pending and isinstance(self._pending[0], RequestOutput) and not run[-1].finished:
            run.append(self._pending.popleft())
        return merge_deltas(run)

    @property
    def num_pending(self) -> int:
        """Items delivered and not yet read."""
        return len(self._pending)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:  # the consumer went away (client disconnect, cancellation)
                self.abort()

    async def result(self) -> RequestOutput:
        """Wait for the final output: the whole result, for DELTA outputs too (merged once, at the end)."""
        outputs: list[RequestOutput] = []
        async for output in self:
            if output.kind != RequestOutputKind.DELTA:
                outputs.clear()  # a cumulative output holds all the earlier ones
            outputs.append(output)
        assert outputs and outputs[-1].finished
        return dataclasses.replace(merge_deltas(outputs), kind=RequestOutputKind.CUMULATIVE)

    def abort(self) -> None:
        self._engine.abort(self.request_id)
