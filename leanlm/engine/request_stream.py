"""RequestStream: one request's outputs, delivered by the async engine's thread, read by a coroutine."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from leanlm.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from leanlm.engine.async_engine import AsyncLLMEngine


class RequestStream:
    """One request's outputs as an async iterator of cumulative RequestOutputs (the last has finished=True).
    Closing it early (or calling abort) cancels the request in the engine and frees its KV blocks.

    Outputs are cumulative (each holds all the text so far), so a newer one makes an unread older one redundant:
    a queued non-final output is replaced by the next, and at most one non-final output and one final item wait
    here. A client that stops reading therefore costs O(text) memory, not a full copy per step (O(T^2)), and a
    slow reader gets bigger deltas instead of a backlog. Consumers must diff against what they last sent (the SSE
    layer keeps a cursor per choice), never assume one output per token.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, num_seqs: int, client: str | None = None) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs  # sequences it holds in the engine (its n)
        self.client = client  # who asked (an API key or address), for the per-client limit; None: not counted
        self._engine = engine
        self._pending: collections.deque[RequestOutput | BaseException] = collections.deque()  # <= 2 items
        self._ready = asyncio.Event()  # set while _pending is not empty
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._pending[-1] = item  # the newer output holds everything the older one did
        else:
            self._pending.append(item)
        self._ready.set()

    async def _get(self) -> RequestOutput | BaseException:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()

    @property
    def num_pending(self) -> int:
        """Items delivered and not yet read (at most 2)."""
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
        """Wait for the final output."""
        final = None
        async for output in self:
            final = output
        assert final is not None and final.finished
        return final

    def abort(self) -> None:
        self._engine.abort(self.request_id)
