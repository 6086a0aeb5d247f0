"""AsyncLLMEngine: the bridge between asyncio (the HTTP server) and the synchronous LLMEngine.

One thread owns the LLMEngine and loops: apply queued commands (add, abort), run one step, hand the outputs
back. Each request's outputs reach its coroutine through its own RequestStream, which keeps only the newest.
The event loop never touches engine state, and the engine thread touches asyncio only through call_soon_threadsafe.

Which thread runs the engine matters on CPU: libgomp gives every thread that opens OpenMP regions its own
worker team, and once a process has more such workers than CPUs it stops spinning them between regions, so
every parallel op pays a futex wake-up (measured here: 2.4x slower batch-1 decode in a second thread after
the main thread had loaded the model). `leanlm serve` therefore runs the engine loop in the main thread
(`run_loop`) and the HTTP server in another; `start()` (a background thread) suits embedding and tests.

Beam searches run on the same thread, through a BeamSearchDriver (engine/beam_search_driver.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from leanlm.engine.beam_search import BeamSearch, BeamSearchParams
from leanlm.engine.beam_search_driver import BeamSearchDriver
from leanlm.engine.engine import LLMEngine
from leanlm.engine.errors import EngineDeadError, EngineStoppedError, QueueFullError, RequestFailedError
from leanlm.engine.outputs import RequestOutput, SchedulerStats
from leanlm.engine.request_stream import RequestStream
from leanlm.lora_request import LoRARequest
from leanlm.pooling_params import PoolingParams
from leanlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """State published by the engine thread after every step, read by /metrics and /health."""

    scheduler: SchedulerStats
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int  # steps run since start
    last_step_time: float  # time.monotonic() of the latest step or idle wake-up


# Commands from the event loop to the engine thread, applied in order before each step.
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    token_ids: list[int]  # tokenized and validated on the event loop
    params: SamplingParams | PoolingParams
    prompt_text: str | None  # reported back in outputs
    lora_request: LoRARequest | None = None  # its adapter, read and checked on the event loop; None: the base


@dataclass(frozen=True)
class AddBeamSearch:
    request_id: str
    search: BeamSearch  # its prompt already validated and queued inside the search
    prompt_text: str | None


@dataclass(frozen=True)
class Abort:
    request_id: str  # a request or a beam search; unknown or finished ids are ignored


Command = AddRequest | AddBeamSearch | Abort

# Called on the event loop with each output as it is delivered (metrics hook).
OutputListener = Callable[[RequestOutput], None]


class AsyncLLMEngine:
    """Serve an LLMEngine to coroutines. `max_queue` bounds the sequences waiting beyond max_num_seqs, so
    the backlog (and the memory it takes) never grows without bound; `max_seqs_per_client` bounds what one client
    may hold of that, so a few requests with n=128 cannot fill it for everyone."""

    def __init__(
        self, engine: LLMEngine, max_queue: int = 256, idle_wait_s: float = 1.0, max_seqs_per_client: int | None = None
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_seqs_per_client is not None and max_seqs_per_client < 1:
            raise ValueError(f"max_seqs_per_client must be >= 1 or None (no limit), got {max_seqs_per_client}")
        self.engine = engine
        self.max_queue = max_queue
        self.max_in_flight = engine.engine_config.max_num_seqs + max_queue
        self.max_seqs_per_client = max_seqs_per_client
        self._seqs_by_client: collections.Counter[str] = collections.Counter()  # event-loop side
        self.idle_wait_s = idle_wait_s
        self.output_listeners: list[OutputListener] = []
        self._streams: dict[str, RequestStream] = {}  # event-loop side: request id -> stream
        self._num_seqs_in_flight = 0  # event-loop side: sum of num_seqs over _streams
        self._commands: collections.deque[Command] = collections.deque()  # event loop -> engine thread
        self._beam_searches = BeamSearchDriver(engine)  # engine-thread side
        self._wakeup = threading.Condition()
        self._stopping = False
        self._loop_active = False  # run_loop is executing (in whichever thread)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: BaseException | None = None  # what killed run_loop, if something did
        self.snapshot = self._take_snapshot(num_steps=0)

    # -- lifecycle (event loop) -----------------------------------------------------------------------

    def attach(self) -> None:
        """Deliver outputs to the running event loop (call from it before requests arrive)."""
        self._loop = asyncio.get_running_loop()

    def start(self) -> None:
        """Attach to the running event loop and run the engine loop in a background thread."""
        if self._thread is not None or self._loop_active:
            raise RuntimeError("the engine loop is already running")
        self.attach()
        self._thread = threading.Thread(target=self.run_loop, name="leanlm-engine", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Thread-safe: make run_loop abort what is left and return."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """From the event loop: stop the engine loop (joining its thread if it has one) and fail the streams
        still open."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._fail_all(EngineStoppedError("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._loop_active and not self._stopping

    @property
    def max_seqs_per_request(self) -> int:
        """The most sequences one request can ever be admitted with; larger ones are refused, not queued."""
        return min(self.max_in_flight, self.max_seqs_per_client or self.max_in_flight)

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._streams)

    # -- requests (event loop) ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        prompt_text: str | None = None,
        client: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue a request (PoolingParams: an embedding); raises ValueError (bad input), QueueFullError or
        EngineStoppedError at once, so an HTTP handler can answer before it starts streaming.
        `prompt_text` names the text of a prompt given as token ids; `lora_request` its adapter (None: the base)."""
        self._check_accepting()
        text, token_ids = self.engine.tokenize_prompt(prompt)
        prompt_text = text if text is not None else prompt_text
        self.engine.validate(token_ids, params)
        self.engine.prepare_lora(lora_request)
        num_seqs = params.n if isinstance(params, SamplingParams) else 1  # PoolingParams: one embedding
        stream = self._open_stream(request_id, num_seqs, client)
        self._send(AddRequest(stream.request_id, token_ids, params, prompt_text, lora_request))
        return stream

    def add_beam_search(
        self,
        prompt: str | list[int],
        params: BeamSearchParams,
        request_id: str | None = None,
        prompt_text: str | None = None,
        client: str | None = None,
    ) -> RequestStream:
        """Validate and queue a beam search over one prompt; its stream yields one final RequestOutput whose
        completions are the beam_width hypotheses, best score first (logprobs None). Raises like add_request."""
        self._check_accepting()
        text, token_ids = self.engine.tokenize_prompt(prompt)
        request_id = request_id or uuid.uuid4().hex
        # Its beams' request ids start with the search's own id, so concurrent searches never collide.
        search = BeamSearch(self.engine, params, request_id_prefix=f"{request_id}#beam")  # reads config only
        search.add(token_ids, 0)  # validates and queues inside the search; the engine is not touched yet
        stream = self._open_stream(request_id, params.beam_width, client)
        self._send(AddBeamSearch(request_id, search, text if text is not None else prompt_text))
        return stream

    def _check_accepting(self) -> None:
        if self.failure is not None:
            raise EngineStoppedError(
                f"the engine loop died ({type(self.failure).__name__}: {self.failure}); the server must be restarted"
            )
        if self._stopping or self._loop is None:
            raise EngineStoppedError("the engine is not accepting requests (it is stopped or shutting down)")

    def _fail_all(self, error: BaseException) -> None:
        """On the event loop: fail every open stream."""
        for stream in list(self._streams.values()):
            stream._put(error)
        self._streams.clear()
        self._num_seqs_in_flight = 0
        self._seqs_by_client.clear()

    def _open_stream(self, request_id: str | None, num_seqs: int, client: str | None) -> RequestStream:
        if self._num_seqs_in_flight + num_seqs > self.max_in_flight:
            raise QueueFullError(
                f"the server is at capacity ({self._num_seqs_in_flight} sequences in flight, limit "
                f"{self.max_in_flight} = max_num_seqs + max_queue); retry later",
                retry_after_s=1,
            )
        held = self._seqs_by_client[client] if client is not None else 0
        if client is not None and self.max_seqs_per_client is not None and held + num_seqs > self.max_seqs_per_client:
            raise QueueFullError(
                f"you already hold {held} sequences in flight and may hold at most {self.max_seqs_per_client} "
                f"at once (a share of the server's capacity, so others get theirs); retry when some finish",
                retry_after_s=1,
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight; use a unique id")
        stream = RequestStream(self, request_id, num_seqs, client)
        self._streams[request_id] = stream
        self._num_seqs_in_flight += num_seqs
        if client is not None:
            self._seqs_by_client[client] += num_seqs
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._send(Abort(request_id))

    def _send(self, command: Command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """On the event loop: route each output (or failure) to its stream."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # already finished or aborted and forgotten
            if isinstance(item, RequestOutput):
                for listener in self.output_listeners:
                    listener(item)
            stream._put(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
                self._num_seqs_in_flight -= stream.num_seqs
                if stream.client is not None:
                    self._seqs_by_client[stream.client] -= stream.num_seqs
                    if not self._seqs_by_client[stream.client]:
                        del self._seqs_by_client[stream.client]

    # -- the engine loop ----------------------------------------------------------------------------

    def run_loop(self) -> None:
        """The engine loop, in the calling thread, until request_stop() or stop(). If it dies (an error outside
        a step, which fails its requests alone), it records why in `failure`, fails every open stream, makes
        new requests fail at once (503), and re-raises, so the launcher can stop the server."""
        self._loop_active = True
        try:
            self._run()
        except BaseException as exc:
            self.failure = exc
            logger.exception("the engine loop died; failing every request in flight")
            error = EngineStoppedError(f"the engine loop died ({type(exc).__name__}: {exc})")
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.call_soon_threadsafe(self._fail_all, error)
                except RuntimeError:  # the loop closed meanwhile: nobody is waiting
                    pass
            raise
        finally:
            self._loop_active = False

    def _run(self) -> None:
        engine = self.engine
        num_steps = 0
        while True:
            with self._wakeup:
                while (
                    not self._commands
                    and not engine.has_unfinished_requests()
                    and not self._beam_searches.has_searches()
                    and not self._stopping
                ):
                    self._wakeup.wait(self.idle_wait_s)
                    self.snapshot = self._take_snapshot(num_steps)  # keeps /health's heartbeat fresh
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            items = self._apply(commands)
            if stopping:
                self._abort_all(items)
                self._post(items)
                return
            self._beam_searches.admit(items)
            if engine.has_unfinished_requests():
                try:
                    items.extend((out.request_id, out) for out in engine.step())
                except EngineDeadError:
                    raise  # run_loop fails every open stream and the launcher stops the server
                except Exception as exc:  # not one request's fault (those fail alone inside step)
                    logger.exception("engine step failed; failing the requests in flight")
                    self._abort_all(items, RequestFailedError(f"engine step failed: {type(exc).__name__}: {exc}"))
                num_steps += 1
            self._beam_searches.collect(items)
            self.snapshot = self._take_snapshot(num_steps)
            self._post(items)

    def _apply(self, commands: list[Command]) -> list[tuple[str, RequestOutput | BaseException]]:
        items: list[tuple[str, RequestOutput | BaseException]] = []
        for command in commands:
            match command:
                case AddRequest(request_id, token_ids, params, prompt_text, lora):
                    try:
                        self.engine.add_request(
                            token_ids, params, request_id=request_id, prompt_text=prompt_text, lora_request=lora
                        )
                    except Exception as exc:
                        items.append((request_id, RequestFailedError(f"{type(exc).__name__}: {exc}")))
                case AddBeamSearch(request_id, search, prompt_text):
                    self._beam_searches.add(request_id, search, prompt_text)
                case Abort(request_id) if self._beam_searches.abort(request_id):
                    items.append((request_id, RequestOutput(request_id, None, [], None, [], finished=True)))
                case Abort(request_id):
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        items.append((request_id, output))
        return items

    def _abort_all(self, items: list, error: BaseException | None = None) -> None:
        self._beam_searches.abort_all(items, error)
        for request_id in self.engine.unfinished_request_ids():
            output = self.engine.abort_request(request_id)
            if error is not None:
                items.append((request_id, error))
            elif output is not None:
                items.append((request_id, output))

    def _post(self, items: list) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    def _take_snapshot(self, num_steps: int) -> EngineSnapshot:
        stats = self.engine.stats(include_moe=False)
        return EngineSnapshot(
            scheduler=stats.scheduler,
            num_kv_blocks=stats.num_kv_blocks,
            num_free_kv_blocks=stats.num_free_kv_blocks,
            num_steps=num_steps,
            last_step_time=time.monotonic(),
        )
