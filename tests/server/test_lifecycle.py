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


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"LEANLM_API_KEY": "k3y"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "leanlm.cli", "serve", "--model", MODEL, "--port", str(port),
         "--kv-cache-memory-bytes", str(64 << 20), "--shutdown-timeout-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        _wait_healthy(url, proc)
        body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 64, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer k3y", "Content-Type": "application/json"})
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
