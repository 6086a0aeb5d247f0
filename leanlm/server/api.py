"""The HTTP face of `leanlm serve`: a FastAPI app with OpenAI-compatible routes, bearer-key auth, a body
size limit, OpenAI-style error bodies, and client-disconnect handling that frees a request's KV blocks.

Every failure a client can cause ends in a 4xx with {"error": {"message", "type", "param", "code"}}; an
exception inside the engine fails its own request only. Nothing a request does stops the engine loop.
"""

from __future__ import annotations

import asyncio
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
from leanlm.server.guard import GuardMiddleware
from leanlm.server.metrics import ServerMetrics
from leanlm.server.protocol import ChatCompletionRequest, CompletionRequest
from leanlm.server.serving import Job, OpenAIServing


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
