"""A tiny OpenAI-style streaming completions server for load-generator tests, run by uvicorn in a thread.

The prompt is a JSON object that says how to answer: {"ttft": s, "itl": s, "tokens_per_chunk": k,
"usage": bool, "crlf": bool, "fail": "http" | "stream" | "truncate"}; plain text means all defaults.
Every token is the text "tok ", so a request for n tokens should yield "tok " * n.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "stub-model"


@dataclass
class StubState:
    """What the stub saw; touched only on the server's event loop while a run is going."""

    active: int = 0  # streams of this generation open now
    max_active: int = 0  # most streams of this generation open at the same time
    generation: int = 0  # bumped by reset(), so streams a previous test left running are not counted
    payloads: list[dict] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)

    def reset(self) -> None:
        self.generation += 1
        self.active = self.max_active = 0
        self.payloads.clear()
        self.authorizations.clear()

    def open_stream(self) -> int:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        return self.generation

    def close_stream(self, generation: int) -> None:
        if generation == self.generation:
            self.active -= 1


def _spec(prompt: str) -> dict:
    try:
        spec = json.loads(prompt)
    except json.JSONDecodeError:
        return {}
    return spec if isinstance(spec, dict) else {}


def _chunk(data: dict | str, crlf: bool) -> bytes:
    end = "\r\n\r\n" if crlf else "\n\n"
    return f"data: {data if isinstance(data, str) else json.dumps(data)}{end}".encode()


async def _events(body: dict, spec: dict, state: StubState, generation: int):
    crlf, fail = spec.get("crlf", False), spec.get("fail")
    num_tokens, per_chunk = body["max_tokens"], spec.get("tokens_per_chunk", 1)
    try:
        yield b": ping\n\n"  # a comment line, as sse-starlette servers send; clients must skip it
        await asyncio.sleep(spec.get("ttft", 0.0))
        sent = 0
        while sent < num_tokens:
            if sent:
                await asyncio.sleep(spec.get("itl", 0.0))
            n = min(per_chunk, num_tokens - sent)
            yield _chunk(
                {"object": "text_completion", "choices": [{"index": 0, "text": "tok " * n, "finish_reason": None}]},
                crlf,
            )
            sent += n
            if fail == "stream":
                yield _chunk({"error": {"message": "boom", "type": "server_error"}}, crlf)
                return
            if fail == "truncate":
                return
        yield _chunk({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, crlf)
        if spec.get("usage", True) and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": num_tokens}
            yield _chunk({"choices": [], "usage": usage}, crlf)
        yield _chunk("[DONE]", crlf)
    finally:
        state.close_stream(generation)


def build_app(state: StubState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.payloads.append(body)
        state.authorizations.append(request.headers.get("authorization"))
        spec = _spec(body["prompt"])
        if spec.get("fail") == "http":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        generation = state.open_stream()
        return StreamingResponse(_events(body, spec, state, generation), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serve_in_thread(app: FastAPI):
    """Serve `app` on a free loopback port in a daemon thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the stub server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
