"""What the async engine raises to its callers (the server maps each to an HTTP status)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The engine already holds as many sequences as it may queue; the client should retry later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStoppedError(RuntimeError):
    """The engine loop has stopped (shutdown, or it died); no new requests are accepted."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (and only it); the message says why."""


class EngineDeadError(RuntimeError):
    """A part of the engine outside this process (a tensor- or pipeline-parallel rank) died, hung or failed: no step
    can run again. Never one request's fault: the executor does not isolate it, and the server stops (exit 1)."""
