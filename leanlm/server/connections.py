"""How many HTTP connections the server keeps, and for how long a connection may stay silent: uvicorn's h11
protocol with a cap on open connections (the oldest idle one makes room for a new one), a few reserved
connections that answer only /health, a deadline for each request head and an idle limit while a body arrives.

Why: uvicorn alone accepts every connection and never times out one that sends nothing, so one client holding
~1000 silent sockets (a common open-file limit) starved every other client, /health included.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# Open files the process needs besides client sockets (the listening socket, model and tokenizer files, logs,
# the engine's threads and pipes): the derived connection limit leaves this many, and a quarter of the rest.
FD_HEADROOM = 256
FD_MARGIN = 64  # beyond the files already open when the limits are derived: what the engine may still open
DEFAULT_MAX_CONNECTIONS = 2048  # enough for every admitted request (max_num_seqs + max_queue) plus idle clients
# The listen backlog is also how many connections asyncio accepts in one burst, each an open file, before any of
# them reaches the guard: with uvicorn's 2048 a burst alone passed a 1024 open-file limit (EMFILE, /health
# unanswered though the guard held its cap). It counts against the open-file budget; nginx uses 511.
MAX_BACKLOG = 511
HEALTH_PATH = "/health"


@dataclass(frozen=True)
class ConnectionLimits:
    """What ConnectionGuard enforces (from ServeConfig; `connection_limits` derives the cap)."""

    max_connections: int  # open connections; at the cap a new one replaces the oldest idle one
    reserved_connections: int  # beyond the cap, when every connection is busy: these answer /health only
    header_timeout_s: float  # from open (or the end of the previous response) to a complete request head
    body_timeout_s: float  # longest wait for the next byte of a request body the client still owes
    backlog: int = 128  # the listen backlog: connections the kernel queues and asyncio accepts in one burst

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.reserved_connections < 1 or self.backlog < 1:
            raise ValueError(
                f"max_connections and reserved_connections must be >= 1, got {self.max_connections} and "
                f"{self.reserved_connections}"
            )
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError(f"timeouts must be > 0, got {self.header_timeout_s} and {self.body_timeout_s}")


def files_in_use() -> int:
    """Files this process holds now (0 where /proc is not there to say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def open_file_limit() -> int | None:
    """The process's soft limit on open files (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connection_limits(
    max_connections: int | None, reserved_connections: int, header_timeout_s: float, body_timeout_s: float
) -> ConnectionLimits:
    """The limits `leanlm serve` runs with. Open connections, the reserve and one accept burst (the backlog) must
    fit the open-file limit less FD_HEADROOM, or less the files already open and FD_MARGIN when that is more (a
    process that already holds many, another server's among them); unset max_connections takes three quarters of
    what is left, at most DEFAULT_MAX_CONNECTIONS. A limit the open-file limit cannot hold is a ValueError saying
    what to change, rather than accept() failing with EMFILE under load."""
    fds = open_file_limit()
    kept = max(FD_HEADROOM, files_in_use() + FD_MARGIN)
    usable = None if fds is None else fds - kept
    backlog = MAX_BACKLOG if usable is None else max(1, min(MAX_BACKLOG, usable // 8))
    if max_connections is None:
        budget = DEFAULT_MAX_CONNECTIONS if usable is None else (usable - backlog) * 3 // 4 - reserved_connections
        if budget < 1:
            raise ValueError(f"the open-file limit ({fds}) leaves no room for connections; raise it (ulimit -n 4096)")
        max_connections = min(DEFAULT_MAX_CONNECTIONS, budget)
    elif usable is not None and max_connections + reserved_connections + backlog > usable:
        raise ValueError(
            f"max_connections {max_connections} + reserved_connections {reserved_connections} + a listen backlog "
            f"of {backlog} need more open files than this process may have ({fds}, {kept} kept for the "
            f"model and the engine): raise the limit (ulimit -n) or lower --max-connections"
        )
    return ConnectionLimits(max_connections, reserved_connections, header_timeout_s, body_timeout_s, backlog)


class ConnectionGuard:
    """The open connections of one server, oldest first. Used only from the server's event loop (no lock)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: dict[GuardedH11Protocol, None] = {}  # insertion order is age: eviction takes the oldest idle
        self.num_evicted = 0  # idle connections closed to make room
        self.num_refused = 0  # connections closed on arrival: every slot busy, the reserve included
        self.num_timed_out = 0  # closed by the header or body timeout
        self._at_limit = False  # logged once per episode, not once per connection

    def admit(self, conn: GuardedH11Protocol) -> str:
        """'normal', 'reserve' (it may ask for /health only) or 'refuse' for a new connection."""
        cap = self.limits.max_connections
        if len(self.open) >= cap:
            idle = next((c for c in self.open if not c.is_busy), None)
            if idle is not None:
                self.num_evicted += 1
                idle.drop("evicted")
            if not self._at_limit:
                self._at_limit = True
                logger.warning(
                    "%d HTTP connections open (--max-connections): new ones replace the oldest idle one; with "
                    "every one busy, %d more answer /health only",
                    cap,
                    self.limits.reserved_connections,
                )
        if len(self.open) < cap:
            kind = "normal"
        elif len(self.open) < cap + self.limits.reserved_connections:
            kind = "reserve"
        else:
            self.num_refused += 1
            return "refuse"
        self.open[conn] = None
        return kind

    def release(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)
        if self._at_limit and len(self.open) < self.limits.max_connections // 2:
            self._at_limit = False

    @property
    def num_busy(self) -> int:
        return sum(c.is_busy for c in self.open)


async def _health_only(app, scope, receive, send) -> None:
    """A reserved connection's app: /health as usual, anything else a 503 that closes the connection."""
    if scope["type"] != "http" or scope["path"] == HEALTH_PATH:
        return await app(scope, receive, send)
    from leanlm.server.error_body import error_response  # the one shape of every error body

    response = error_response(
        503,
        "the server has no free connection for this request: every one is busy; retry shortly",
        "server_error",
        None,
        "unavailable",
        headers={"Retry-After": "1", "Connection": "close"},
    )
    await response(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionGuard (`guard`, set on the subclass guarded_protocol makes).

    A connection is busy from its request head until its response ends; otherwise idle (still sending a head,
    or kept alive between requests), and an idle one may be closed to make room. uvicorn's own keep-alive
    timeout closes a connection that sends nothing after a response; the header deadline also closes one that
    sends a head too slowly, or nothing at all after opening."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._timed_cycle = None  # the request whose head stopped the header deadline
        kind = self.guard.admit(self)
        if kind == "refuse":
            self.drop("refused")
            return
        if kind == "reserve":
            app = self.app
            self.app = lambda scope, receive, send: _health_only(app, scope, receive, send)
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        if not self.transport.is_closing():
            self._track_request()
            if not self.is_busy:
                self._arm_head_deadline()

    @property
    def is_busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def drop(self, why: str) -> None:
        self.guard.release(self)
        self._cancel_timers()
        if not self.transport.is_closing():
            logger.debug("closing connection from %s: %s", self.client, why)
            self.transport.close()

    # -- deadlines --------------------------------------------------------------------------------

    def _track_request(self) -> None:
        """After new events: a new request head stops the header deadline; a body still owed (re)starts the
        body deadline, so it counts from the last byte received."""
        if self.is_busy and self.cycle is not self._timed_cycle:
            self._timed_cycle = self.cycle
            self._cancel(self._head_timer)
        if self.is_busy and self.conn.their_state is h11.SEND_BODY:
            self._cancel(self._body_timer)
            self._body_timer = self.loop.call_later(self.guard.limits.body_timeout_s, self._body_timed_out)
        else:
            self._cancel(self._body_timer)

    def _arm_head_deadline(self) -> None:
        self._cancel(self._head_timer)
        self._head_timer = self.loop.call_later(self.guard.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if not self.is_busy:
            self.guard.num_timed_out += 1
            self.drop(f"no complete request head within {self.guard.limits.header_timeout_s} s")

    def _body_timed_out(self) -> None:
        if self.flow.read_paused:  # the app, not the client, is behind: wait for it
            self._body_timer = self.loop.call_later(self.guard.limits.body_timeout_s, self._body_timed_out)
        elif self.is_busy and self.conn.their_state is h11.SEND_BODY:
            self.guard.num_timed_out += 1
            self.drop(f"no request body byte within {self.guard.limits.body_timeout_s} s")

    def _cancel_timers(self) -> None:
        self._cancel(self._head_timer)
        self._cancel(self._body_timer)

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A protocol class for one server (uvicorn.Config(http=...)): its connections share one guard."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": ConnectionGuard(limits)})
