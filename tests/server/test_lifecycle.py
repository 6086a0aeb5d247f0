"""`leanlm serve` as a real process: it logs what it serves, and on SIGTERM it stops accepting, lets the
in-flight stream finish, and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.server.conftest import MODEL


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited early:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


@pytest.mark.real_model
def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"LEANLM_API_KEY": "k3y"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "leanlm.cli",
            "serve",
            "--model",
            MODEL,
            "--port",
            str(port),
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--shutdown-timeout-s",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        _wait_healthy(url, proc)
        body = {
            "model": MODEL,
            "prompt": "Tell me about the sea.",
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        req = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": "Bearer k3y", "Content-Type": "application/json"},
        )
        events: list = []
        first_event = threading.Event()

        def consume() -> None:
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    if line.startswith(b"data: "):
                        payload = line[6:].strip().decode()
                        events.append(payload if payload == "[DONE]" else json.loads(payload))
                        first_event.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_event.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 64
        assert proc.wait(60) == 0
        with pytest.raises(OSError):  # no longer listening
            urllib.request.urlopen(url + "/health", timeout=2)
        log = proc.stdout.read()
        assert f"serving '{MODEL}'" in log and "KV cache" in log and "context" in log and "auth on" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_the_engine_loop_once_healthy(llm_engine, url: str, monkeypatch) -> threading.Thread:
    """Make the engine loop die (an error outside a step: its idle snapshot) once the server answers /health."""
    real_stats = llm_engine.stats
    healthy = threading.Event()

    def stats(**options):
        if healthy.is_set():
            raise RuntimeError("engine state is corrupt")
        return real_stats(**options)

    monkeypatch.setattr(llm_engine, "stats", stats)

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not healthy.is_set():
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    healthy.set()
            except OSError:
                time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the engine thread re-raises on purpose
def test_a_dead_engine_loop_answers_503_at_once(make_tiny_engine, monkeypatch):
    from tests.server.conftest import serve_engine
    from tests.server.test_safety import _assert_error, _request

    llm_engine = make_tiny_engine(kv_cache_memory_bytes=32 << 20)
    with serve_engine(llm_engine) as server:
        stream = urllib.request.urlopen(
            urllib.request.Request(
                server.url + "/v1/completions",
                headers={"Content-Type": "application/json"},
                data=json.dumps(
                    {"model": MODEL, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
                ).encode(),
            ),
            timeout=30,
        )
        _kill_the_engine_loop_once_healthy(llm_engine, server.url, monkeypatch).join()
        deadline = time.monotonic() + 10
        while server.engine.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # The stream in flight ends with an error event instead of hanging.
        events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        assert "engine loop died" in events[-2] and events[-1] == "data: [DONE]"
        started = time.monotonic()
        status, headers, body = _request(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        _assert_error(status, body, 503)
        assert "engine loop died" in body["error"]["message"] and time.monotonic() - started < 5
        assert _request(server.url, "/health")[0] == 503


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the engine thread re-raises on purpose
def test_serve_stops_and_fails_when_the_engine_loop_dies(make_tiny_engine, monkeypatch):
    """`leanlm serve` must not keep an HTTP server up in front of a dead engine: uvicorn stops, serve() raises
    (and the command exits 1)."""
    import types

    import torch

    from leanlm.config import ServeConfig
    from leanlm.server.launcher import serve

    llm_engine = make_tiny_engine(kv_cache_memory_bytes=32 << 20)
    llm = types.SimpleNamespace(llm_engine=llm_engine, model_config=llm_engine.model_config, dtype=torch.float64)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    watcher = _kill_the_engine_loop_once_healthy(llm_engine, url, monkeypatch)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="engine loop died"):
        serve(llm, MODEL, ServeConfig(port=port, log_level="warning", shutdown_timeout_s=5))
    watcher.join()
    assert time.monotonic() - started < 60
    with pytest.raises(OSError):  # no longer listening
        urllib.request.urlopen(url + "/health", timeout=2)
