"""The HTTP face of `leanlm serve`: a FastAPI app with OpenAI-compatible routes, bearer-key auth, a body
size limit, OpenAI-style error bodies, and client-disconnect handling that frees a request's KV blocks.

Every failure a client can cause ends in a 4xx with {"error": {"message", "type", "param", "code"}}; an
exception inside the engine fails its own request only. Nothing a request does stops the engine loop.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from leanlm.engine import AsyncLLMEngine
from leanlm.server.embeddings import EmbeddingJob, EmbeddingRequest, EmbeddingServing
from leanlm.server.errors import error_response
from leanlm.server.errors import map_exception as _map_exception
from leanlm.server.metrics import ServerMetrics
from leanlm.server.protocol import ChatCompletionRequest, CompletionRequest
from leanlm.server.serving import Job, OpenAIServing


class GuardMiddleware:
    """Pure ASGI (it must not buffer streams). In order: the Host check, the bearer key (compared in constant
    time) on /v1 routes and /metrics, the JSON Content-Type of POST bodies, and a 413 for request bodies over
    `max_bytes`, whether announced by Content-Length or streamed.

    Why the first and third: a web page in the user's browser can POST to http://127.0.0.1:8000 (a "simple"
    cross-site request needs no CORS preflight if its Content-Type is text/plain or a form), and with DNS
    rebinding it can even read the answers, its own host name then resolving to 127.0.0.1. Requiring
    application/json forces the preflight (which this server does not grant); refusing Host names other than
    loopback ones defeats the rebinding. With an API key the page has no key, so any Host is accepted.
    """

    def __init__(
        self,
        app,
        api_key: str | None,
        max_bytes: int,
        metrics_key: str | None = None,
        allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        metrics_key = metrics_key or api_key
        self.expected_metrics = f"Bearer {metrics_key}".encode() if metrics_key else None
        self.max_bytes = max_bytes
        self.check_host = api_key is None and "*" not in allowed_hosts
        self.allowed_hosts = frozenset(h.lower().rstrip(".") for h in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        refusal = self._refusal(scope["path"], scope["method"], headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0
        more_body = True

        async def limited_receive():
            nonlocal received, more_body
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more_body = message.get("more_body", False)
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            # Read (and drop) the rest of a moderately oversized body first: a client still sending when the
            # answer comes sees a connection reset instead of the 413.
            budget = 8 * self.max_bytes
            while more_body and budget > 0:
                message = await receive()
                if message["type"] != "http.request":
                    break
                budget -= len(message.get("body", b""))
                more_body = message.get("more_body", False)
            await self._refuse(scope, receive, send)

    def _refusal(self, path: str, method: str, headers: dict[bytes, bytes]) -> JSONResponse | None:
        """The answer to a request refused before it reaches a route, or None."""
        if self.check_host:
            name = host_name(headers.get(b"host", b""))
            if not (is_loopback(name) or name in self.allowed_hosts):
                return error_response(
                    403,
                    f"the Host {name!r} is not allowed: without an API key this server answers only requests "
                    f"addressed to a loopback name (localhost, 127.x.x.x, [::1]); start it with --api-key, or "
                    f"name this host in --allowed-hosts",
                    "invalid_request_error",
                    None,
                    "host_not_allowed",
                )
        expected = self.expected_metrics if path == "/metrics" else self.expected if path.startswith("/v1") else None
        if expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), expected):
            return error_response(
                401,
                "missing or wrong API key; send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )
        if method in ("POST", "PUT", "PATCH"):
            media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media_type != b"application/json":
                return error_response(
                    415,
                    f"the request body must be sent with 'Content-Type: application/json', not "
                    f"{media_type.decode('latin-1') or 'none'!r}",
                    "invalid_request_error",
                    None,
                    "unsupported_media_type",
                )
        return None

    async def _refuse(self, scope, receive, send) -> None:
        response = error_response(
            413,
            f"the request body is larger than {self.max_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def host_name(host: bytes) -> str:
    """The name in a Host header, lower-cased, without port or trailing dot: 'localhost', '127.0.0.1', '::1'."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):  # [v6 address]:port
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:
        text = text.split(":")[0]
    return text.rstrip(".")


def is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback  # 127.0.0.0/8 and ::1
    except ValueError:
        return False


class _Hangup:
    """What a client's hang-up stops: its request's preparation while that runs, then its engine requests."""

    def __init__(self, accepting: asyncio.Future) -> None:
        self.accepting = accepting  # parsing and tokenizing, in the prepare threads
        self.job: Job | None = None  # set once the engine requests are queued
        self.happened = False

    def __call__(self) -> None:
        self.happened = True
        self.accepting.cancel()
        if self.job is not None:
            self.job.abort()


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away, then call on_disconnect (which cancels or aborts its work)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def build_app(
    engine: AsyncLLMEngine,
    model_names: list[str],
    api_key: str | None = None,
    max_body_bytes: int = 16 * 1024 * 1024,
    start_engine: bool = True,
    metrics_key: str | None = None,
    allowed_hosts: tuple[str, ...] = (),
    enable_docs: bool = False,
    default_max_tokens: int | None = 1024,
    max_prompt_chars: int | None = None,
    max_pending_prepares: int = 64,
    chat_control_tokens: str = "text",
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app; it stops the engine loop on shutdown. On startup it runs the engine loop in a background thread,
    or, with start_engine=False, only attaches to the event loop (the caller runs `engine.run_loop()`).

    /metrics needs `metrics_key`, else `api_key`, when either is set. Without an API key only loopback Host names
    and `allowed_hosts` ("*": any) are answered. /docs and /openapi.json exist only with enable_docs (and are then
    open: the page that shows them sends no key)."""
    serving = OpenAIServing(
        engine,
        model_names,
        default_max_tokens,
        max_prompt_chars=max_prompt_chars,
        max_pending_prepares=max_pending_prepares,
        chat_control_tokens=chat_control_tokens,
        tool_call_parser=tool_call_parser,
    )
    embedder = EmbeddingServing(serving, engine.engine.model_config.hidden_size)
    metrics = ServerMetrics(engine, model_names[0])
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start() if start_engine else engine.attach()
        try:
            yield
        finally:
            engine.stop()
            serving.close()

    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="LeanLM", lifespan=lifespan, **docs)
    app.state.serving = serving
    app.state.metrics = metrics
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_bytes=max_body_bytes,
        metrics_key=metrics_key,
        allowed_hosts=tuple(allowed_hosts),
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Routing's own errors (an unknown path, a wrong method) in the same OpenAI shape as every other error,
        not FastAPI's {"detail": ...}; headers such as a 405's Allow are kept."""
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = {
            404: f"no route {request.url.path!r}; the API is under /v1 (see /v1/models)",
            405: f"{request.method} is not allowed on {request.url.path!r}",
        }.get(exc.status_code, str(exc.detail))
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, message, err_type, None, codes.get(exc.status_code), exc.headers)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine loop is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        data = serving.served.listing(started, serving.max_model_len)
        return JSONResponse({"object": "list", "data": data})

    async def handle(
        request: Request,
        schema: type[BaseModel],
        start: Callable[[BaseModel, str | None], Awaitable[Job | EmbeddingJob]],
        respond: Callable[[Job | EmbeddingJob], Awaitable[dict]] = serving.full_response,
    ) -> Response:
        raw = await request.body()  # outside the try: an oversized body must reach GuardMiddleware

        async def accept() -> tuple[BaseModel, Job]:
            body = await serving.off_loop(schema.model_validate_json, raw)
            # The per-client limit counts by address: with one shared API key, the key names no one client.
            return body, await start(body, request.client.host if request.client else None)

        # One watcher for the whole request: a hang-up while it is queued for (or in) preparation cancels that
        # work; after it has started, it aborts the engine requests (freeing their KV blocks).
        accepting = asyncio.ensure_future(accept())
        hangup = _Hangup(accepting)
        watcher = asyncio.ensure_future(_watch_disconnect(request, hangup))
        try:
            body, job = await accepting
        except asyncio.CancelledError:
            watcher.cancel()
            if hangup.happened:  # nobody to answer
                return Response(status_code=499)
            raise
        except Exception as exc:  # everything here is the client's input or the server's capacity
            watcher.cancel()
            return _map_exception(exc)
        hangup.job = job
        if body.stream:
            return StreamingResponse(
                _streamed(job, watcher), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            return JSONResponse(await respond(job))
        except Exception as exc:
            job.abort()
            return _map_exception(exc)
        finally:
            watcher.cancel()

    async def _streamed(job: Job, watcher: asyncio.Future):
        try:
            async for event in serving.sse_stream(job):
                yield event
        finally:
            watcher.cancel()
            job.abort()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest, serving.start_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest, serving.start_chat)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await handle(request, EmbeddingRequest, embedder.start, embedder.response)

    return app
