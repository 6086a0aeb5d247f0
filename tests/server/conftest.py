"""Real uvicorn servers on loopback ports, in background threads: one over the real SmolLM2 (float32), and a
factory over tiny random engines for the tests that need odd limits."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from leanlm.config.serve import ServeConfig
from leanlm.engine.async_engine import AsyncLLMEngine
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.server.api import build_app
from leanlm.server.http_config import uvicorn_config

MODEL = DEFAULT_MODEL
CONNECTION_OPTIONS = (
    "max_connections",
    "reserved_connections",
    "header_timeout_s",
    "keep_alive_timeout_s",
    "body_timeout_s",
)


class LiveServer:
    """`with LiveServer(app) as server:` serves `app` on 127.0.0.1 at an ephemeral port until the block ends."""

    def __init__(self, app, **serve_options) -> None:
        self.app = app
        config = ServeConfig(host="127.0.0.1", port=0, log_level="warning", shutdown_timeout_s=5, **serve_options)
        self.server = uvicorn.Server(uvicorn_config(app, config))  # the settings `leanlm serve` runs with
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self):
        """The server's ConnectionGuard (leanlm/server/connections.py)."""
        return self.server.config.http.guard

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.app.state.serving.engine


def serve_engine(
    llm_engine, api_key: str | None = None, max_queue: int = 256, max_body_bytes: int = 1 << 20, **app_options
):
    """A LiveServer over `llm_engine`; app_options go to build_app (metrics_key, allowed_hosts, ...), except
    forwarded_allow_ips and the connection limits (CONNECTION_OPTIONS), which go to uvicorn's settings as
    `leanlm serve`'s flags do."""
    async_engine = AsyncLLMEngine(
        llm_engine, max_queue=max_queue, max_seqs_per_client=app_options.pop("max_seqs_per_client", None)
    )
    serve_options = {"forwarded_allow_ips": app_options.pop("forwarded_allow_ips", "")}
    serve_options |= {name: app_options.pop(name) for name in CONNECTION_OPTIONS if name in app_options}
    app = build_app(async_engine, [MODEL], api_key=api_key, max_body_bytes=max_body_bytes, **app_options)
    return LiveServer(app, **serve_options)


@pytest.fixture(scope="session")
def real_llm():
    from leanlm.llm import LLM

    return LLM(MODEL, dtype="float32", kv_cache_memory_bytes=256 << 20, progress=False)


@pytest.fixture(scope="session")
def real_server(real_llm):
    with serve_engine(real_llm.llm_engine) as server:
        yield server


@pytest.fixture
def openai_client(real_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not reached in time")
