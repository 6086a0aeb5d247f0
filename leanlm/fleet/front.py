"""The data-parallel front: an OpenAI-compatible proxy on the user's --host/--port that sends each request to one
replica (router.py) over plain HTTP (aiohttp), passing answers and SSE streams through unchanged. A replica that
breaks fails only the requests it held: 502 with an OpenAI error body, or an `error` event in a started stream. A
replica that stalls (alive, silent: no bytes within --replica-read-timeout-s, or its /health failing) hands the
requests it has not started answering to another replica; those it cannot, 504. Bodies get the server's own bounds
(size, nesting, message and prompt counts) before anything parses them whole or tokenizes them."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import aiohttp
import pydantic_core
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from leanlm.config import RouterConfig, ServeConfig
from leanlm.fleet import front_metrics
from leanlm.fleet.affinity import PromptKeyer
from leanlm.fleet.replicas import (
    HEALTH_TIMEOUT_S,
    HealthMonitor,
    Replica,
    start_local,
    stop_local,
    wait_until_ready,
)
from leanlm.fleet.router import NoReplicaError, Router
from leanlm.loading.tokenizer import Tokenizer
from leanlm.parallel.machine import cores_per_process, free_port
from leanlm.server import MAX_MESSAGES, MAX_PROMPTS, GuardMiddleware, error_response, uvicorn_config

logger = logging.getLogger("leanlm.router")

PASSED_HEADERS = ("content-type", "retry-after", "cache-control")  # of a replica's answer, to the client
READ_TIMEOUT_S = 600.0  # RouterConfig.replica_read_timeout_s's default


class ReplicaStalled(Exception):
    """The replica left the rotation (its /health failed) while a request waited on it."""


def screen(raw: bytes) -> dict | JSONResponse:
    """The body parsed, or the 400 the server itself would answer, given before the front keys (tokenizes) it:
    nesting bounded by the parser (json.loads raised RecursionError: a plain-text 500), and the message and prompt
    counts the server's schema allows (450k messages took the keyer ~3 s before the replica refused them)."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError as exc:
        return error_response(400, f"the body is not valid JSON (Invalid JSON: {exc})", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "the body must be a JSON object", "invalid_request_error")
    # the messages of ChatCompletionRequest, the prompts of CompletionRequest._check_prompt: the same words
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        message = f"messages: List should have at most {MAX_MESSAGES} items after validation, not {len(messages)}"
        return error_response(400, message, "invalid_request_error", "messages")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not all(type(t) is int for t in prompt):
        message = f"prompt: Value error, at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompt)}"
        return error_response(400, message, "invalid_request_error", "prompt")
    return body


def _end_exchange(replica: Replica, response: aiohttp.ClientResponse) -> None:
    if response.content.at_eof():
        response.release()  # the connection goes back to the pool
    else:
        response.close()  # the replica sees a hang-up and aborts the request (frees its KV blocks)
    replica.num_in_flight -= 1


class _Upstream:
    """One request's exchange with its replica: sends it, keeps the in-flight count, and ends it once."""

    def __init__(self, front: Front, replica: Replica, response: aiohttp.ClientResponse) -> None:
        self.front, self.replica, self.response = front, replica, response
        # Runs once: from finish(), or when this object is collected unfinished (a stream whose client hung up
        # before its first chunk: Starlette never starts the generator, so its `finally` never runs).
        self._end = weakref.finalize(self, _end_exchange, replica, response)

    def headers(self) -> dict[str, str]:
        return {k: v for k, v in self.response.headers.items() if k.lower() in PASSED_HEADERS}

    def finish(self) -> None:
        self._end()

    def broke(self, exc: BaseException) -> str:
        self.replica.num_failed += 1
        self.front.monitor.mark_down(self.replica, f"a request's connection broke ({type(exc).__name__}: {exc})")
        return f"replica {self.replica.name} failed while answering ({type(exc).__name__}: {exc}); retry the request"


class Front:
    """The state behind the app: the replicas, their health monitor, the router and the prompt keyer."""

    def __init__(
        self,
        replicas: list[Replica],
        router: Router,
        keyer: PromptKeyer,
        health_interval_s: float,
        read_timeout_s: float = READ_TIMEOUT_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        self.replicas = replicas
        self.by_url = {r.url: r for r in replicas}
        self.router = router
        self.keyer = keyer
        self.health_interval_s = health_interval_s
        self.read_timeout_s = read_timeout_s
        self.monitor = HealthMonitor(replicas, on_down=self._on_down, timeout_s=health_timeout_s)
        self.metrics = front_metrics.FrontMetrics(replicas)
        self.session: aiohttp.ClientSession | None = None
        self._keying = ThreadPoolExecutor(2, thread_name_prefix="leanlm-route")  # tokenizing off the event loop
        # replica url -> set when it leaves the rotation; whoever waits on that replica gives up (a new one is made
        # for its next fall). Made and set on the event loop only.
        self._down: dict[str, asyncio.Event] = {}

    async def open(self) -> None:
        # No total timeout: a long generation may stream for minutes; connecting must be quick (loopback or LAN),
        # and a replica that sends nothing for read_timeout_s is stalled.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.read_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.session.close()
        self._keying.shutdown(wait=False, cancel_futures=True)

    def _on_down(self, replica: Replica) -> None:
        self.router.forget(replica.url)
        event = self._down.pop(replica.url, None)
        if event is not None:
            event.set()

    async def unless_down(self, replica: Replica, awaitable):
        """`awaitable`'s result, or ReplicaStalled as soon as the health monitor takes `replica` out of rotation."""
        down = self._down.setdefault(replica.url, asyncio.Event())
        work = asyncio.ensure_future(awaitable)
        watch = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            watch.cancel()
        if work.done():
            return work.result()
        work.cancel()
        raise ReplicaStalled(f"its /health failed while the request waited on it (over {self.monitor.timeout_s:g} s)")

    async def send(self, path: str, raw: bytes, client: str | None) -> _Upstream | Response:
        """Screen, route and send. A stream comes back as an _Upstream once its status is in; a whole answer as a
        Response. A request no replica has started answering moves on when its replica refuses the connection or
        stalls (the stalled one leaves the rotation); with no replica left it gets 503, or 504 after a stall."""
        checked = await asyncio.get_running_loop().run_in_executor(self._keying, self._key, path, raw)
        if isinstance(checked, Response):
            return checked
        hashes = checked
        headers = {"Content-Type": "application/json", **({"X-Forwarded-For": client} if client else {})}
        tried: set[str] = set()  # replicas that stalled on this request
        stalled: str | None = None  # why the last one gave up
        while True:
            loads = {r.url: r.num_in_flight for r in self.monitor.in_rotation() if r.url not in tried}
            if not loads and stalled is not None:
                return error_response(504, stalled + "; no other replica is in rotation", "server_error", None,
                                      "replica_timeout")  # fmt: skip
            try:
                route = self.router.choose(hashes, loads)
            except NoReplicaError as exc:
                return error_response(503, str(exc), "server_error", None, "unavailable", {"Retry-After": "5"})
            replica = self.by_url[route.replica]
            replica.num_routed += 1
            replica.num_prefix_hits += route.matched_blocks > 0
            replica.num_in_flight += 1
            request = self.session.post(replica.url + path, data=raw, headers={**headers, **replica.headers})
            try:
                response = await self.unless_down(replica, request)
            except asyncio.CancelledError:  # the client hung up while the request was being sent
                replica.num_in_flight -= 1
                raise
            except aiohttp.ClientConnectorError as exc:  # not delivered: safe to send elsewhere
                replica.num_in_flight -= 1
                replica.num_failed += 1
                self.monitor.mark_down(replica, f"connection refused ({exc})")
                continue
            except (ReplicaStalled, TimeoutError) as exc:  # nothing answered yet: another replica may
                replica.num_in_flight -= 1
                stalled = self._stalled(replica, exc)
                tried.add(replica.url)
                continue
            except (aiohttp.ClientError, OSError) as exc:
                replica.num_in_flight -= 1
                replica.num_failed += 1
                self.monitor.mark_down(replica, f"a request's connection broke ({type(exc).__name__}: {exc})")
                message = f"replica {replica.name} failed before answering ({type(exc).__name__}: {exc}); retry"
                return error_response(502, message, "server_error", None, "replica_failed")
            upstream = _Upstream(self, replica, response)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return upstream
            # A whole answer is read here: until its last byte nothing went to the client, so a stall can move on.
            try:
                body = await self.unless_down(replica, response.read())
            except (ReplicaStalled, TimeoutError) as exc:
                stalled = self._stalled(replica, exc)
                tried.add(replica.url)
                continue
            except (aiohttp.ClientError, OSError) as exc:
                return error_response(502, upstream.broke(exc), "server_error", None, "replica_failed")
            finally:
                upstream.finish()
            return Response(body, status_code=response.status, headers=upstream.headers())

    def _key(self, path: str, raw: bytes) -> tuple[int, ...] | Response:
        body = screen(raw)
        return body if isinstance(body, Response) else self.keyer.key(path, body)

    def _stalled(self, replica: Replica, exc: BaseException) -> str:
        """Count a stall, take the replica out of rotation, and say what happened (for a 504 if nobody is left)."""
        replica.num_failed += 1
        if isinstance(exc, ReplicaStalled):
            why = str(exc)
        else:
            why = f"no bytes within --replica-read-timeout-s {self.read_timeout_s:g} ({type(exc).__name__})"
        self.monitor.mark_down(replica, f"stalled: {why}")
        return f"replica {replica.name} stalled: {why}"

    async def stream(self, upstream: _Upstream) -> AsyncIterator[bytes]:
        """The replica's SSE bytes as they come; a break or a stall becomes an `error` event and `[DONE]` (the status
        is sent: the request cannot move to another replica)."""
        tail = b""
        chunks = upstream.response.content.iter_any()
        try:
            while True:
                try:
                    chunk = await self.unless_down(upstream.replica, anext(chunks))
                except StopAsyncIteration:
                    break
                tail = (tail + chunk)[-64:]
                yield chunk
            if b"[DONE]" not in tail:
                raise aiohttp.ClientPayloadError("the stream ended before data: [DONE]")
        except (ReplicaStalled, TimeoutError) as exc:
            error = {"message": self._stalled(upstream.replica, exc), "type": "server_error", "param": None,
                     "code": "replica_timeout"}  # fmt: skip
            yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
        except (aiohttp.ClientError, OSError) as exc:
            error = {"message": upstream.broke(exc), "type": "server_error", "param": None, "code": "replica_failed"}
            yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()
        finally:
            upstream.finish()


async def _cancel_on_disconnect(request: Request, task: asyncio.Future) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    task.cancel()


def build_front_app(front: Front, config: ServeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.open()
        checks = asyncio.ensure_future(front.monitor.run(front.session, front.health_interval_s))
        try:
            yield
        finally:
            checks.cancel()
            await front.close()

    app = FastAPI(title="LeanLM router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    app.add_middleware(
        GuardMiddleware,
        api_key=config.api_key,
        max_bytes=config.max_body_bytes,
        metrics_key=config.metrics_key,
        allowed_hosts=config.allowed_host_names,
    )

    @app.get("/health")
    async def health() -> Response:
        replicas = [r.describe() for r in front.replicas]
        if not front.monitor.in_rotation():
            return JSONResponse({"status": "unavailable", "replicas": replicas}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": replicas})

    @app.get("/metrics")
    async def metrics() -> Response:
        pages = await front_metrics.scrape(front.session, front.replicas)
        return PlainTextResponse(front_metrics.render(front.metrics, pages), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        # answered at once by a live replica, like /health: a stalled one must not hold it for the read timeout
        timeout = aiohttp.ClientTimeout(total=front.monitor.timeout_s)
        for replica in sorted(front.monitor.in_rotation(), key=lambda r: r.num_in_flight):
            try:
                get = front.session.get(replica.url + "/v1/models", headers=replica.headers, timeout=timeout)
                async with get as response:
                    body = await response.read()
                    return Response(body, status_code=response.status, media_type="application/json")
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                front.monitor.mark_down(replica, f"/v1/models failed ({type(exc).__name__}: {exc})")
        return error_response(503, "no replica is in rotation", "server_error", None, "unavailable")

    async def proxy(request: Request, path: str) -> Response:
        raw = await request.body()  # GuardMiddleware has limited its size
        client = request.client.host if request.client else None
        sending = asyncio.ensure_future(front.send(path, raw, client))
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, sending))
        try:
            upstream = await sending
            if isinstance(upstream, Response):
                return upstream
            watcher.cancel()  # StreamingResponse watches for the hang-up itself
            return StreamingResponse(
                front.stream(upstream), status_code=upstream.response.status, headers=upstream.headers()
            )
        except asyncio.CancelledError:
            return Response(status_code=499)  # the client hung up: nobody to answer
        finally:
            watcher.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await proxy(request, "/v1/embeddings")  # no prompt to key: the least loaded replica

    return app


def serve_routed(
    serve_args: list[str], tokenizer: Tokenizer, block_size: int, config: ServeConfig, router_config: RouterConfig
) -> None:
    """Start the local replicas (`leanlm serve SERVE_ARGS` each), wait for them, serve the front until SIGINT/SIGTERM
    (uvicorn's graceful shutdown), then stop the replicas. RuntimeError (exit 1) when no replica comes up."""
    num_local = router_config.data_parallel_size
    threads = config.threads or cores_per_process(num_local)
    internal_key = secrets.token_urlsafe(24)  # local replicas answer only the front (and who reads its memory)
    replicas: list[Replica] = []
    try:
        for _ in range(num_local):
            replicas.append(start_local(serve_args, free_port(), threads, internal_key, config.log_level))
        replicas += [Replica(url, api_key=router_config.replica_api_key) for url in router_config.replica_urls]
        logger.info("starting %d local replica(s) with %d thread(s) each", num_local, threads)
        wait_until_ready(replicas, router_config.replica_start_timeout_s, router_config.health_check_timeout_s)
        router = Router(
            router_config.router_policy,
            router_config.balance_abs_threshold,
            router_config.balance_rel_threshold,
            router_config.router_cache_entries,
        )
        keyer = PromptKeyer(tokenizer, block_size, router_config.router_prefix_blocks)
        front = Front(
            replicas,
            router,
            keyer,
            router_config.health_check_interval_s,
            read_timeout_s=router_config.replica_read_timeout_s,
            health_timeout_s=router_config.health_check_timeout_s,
        )
        server = uvicorn.Server(uvicorn_config(build_front_app(front, config), config))
        logger.info(
            "routing (%s) over %s at http://%s:%d/v1",
            router.policy,
            ", ".join(r.name for r in replicas),
            config.host,
            config.port,
        )
        server.run()
        if not server.started:
            raise RuntimeError(f"the HTTP server did not start on {config.host}:{config.port}; see the log")
    finally:
        stop_local(replicas, config.shutdown_timeout_s)
