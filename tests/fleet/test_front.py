"""The data-parallel front. Fast tier: the front app in this process over two tiny-engine servers (remote
replicas). Real tier: `leanlm serve --data-parallel-size 2` as users run it, a front process over two real SmolLM2
replica processes on loopback, driven by the real `openai` client; its last test kills a replica."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest

from leanlm.analysis.peers import ServerProcess, leanlm_server
from leanlm.config import ServeConfig
from leanlm.fleet.affinity import PromptKeyer
from leanlm.fleet.front import Front, build_front_app
from leanlm.fleet.replicas import Replica, wait_until_ready
from leanlm.fleet.router import Router
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.parallel.machine import free_port
from tests.server.conftest import MODEL, LiveServer, serve_engine

KEY = "front-test-key"
# A system prompt of well over 4 KV blocks (64 tokens), so requests that share it share their affinity key.
SYSTEM = {
    "support": "You are the support assistant of a small bakery. " * 12,
    "weather": "You are a weather bot that answers in one short sentence about clouds and rain. " * 8,
    "kill": "You are a pirate who speaks of ships, sails, ropes, and the sea in every single answer. " * 8,
}


@pytest.fixture(scope="module")
def front():
    """The front process (and its two replica processes), shared by the module's real-model tests."""
    port = free_port()
    flags = "--data-parallel-size 2 --threads 1 --dtype float32 --max-model-len 512 --num-kv-blocks 64"
    flags += f" --api-key {KEY} --health-check-interval-s 0.5 --router-policy cache_aware"
    server = leanlm_server(DEFAULT_MODEL, port, tuple(flags.split()))
    server.startup_timeout_s = 300
    with server:
        yield server


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=front.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def get(front: ServerProcess, path: str) -> tuple[int, str]:
    request = urllib.request.Request(front.url + path, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def routed(front: ServerProcess) -> dict[str, tuple[float, float]]:
    """Replica url -> (requests routed, prefix hits), from the front's /metrics."""
    counts: dict[str, list[float]] = {}
    for line in get(front, "/metrics")[1].splitlines():
        for name, slot in (("leanlm_router_requests_routed_total{", 0), ("leanlm_router_prefix_hits_total{", 1)):
            if line.startswith(name):
                url = line.split('replica="')[1].split('"')[0]
                counts.setdefault(url, [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {url: (c[0], c[1]) for url, c in counts.items()}


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


# ------------------------------------------------------------------------------ fast: tiny engines in-process


@pytest.fixture
def tiny_front(make_tiny_engine, tokenizer):
    """A front (key "k") in this process over two tiny-engine servers; yields (front server, Front, replica servers).
    No periodic health checks here (they would race the refusals the tests make); test_replicas.py has those."""
    options = dict(dtype=__import__("torch").float32, kv_cache_memory_bytes=16 << 20, block_size=4)
    with serve_engine(make_tiny_engine(**options)) as one, serve_engine(make_tiny_engine(**options)) as two:
        replicas = [Replica(one.url), Replica(two.url)]
        wait_until_ready(replicas, timeout_s=10)
        state = Front(replicas, Router("cache_aware"), PromptKeyer(tokenizer, 4, 4), health_interval_s=60)
        with LiveServer(build_front_app(state, ServeConfig(api_key="k", max_body_bytes=4096))) as server:
            yield server, state, (one, two)


def post(url: str, path: str, body: dict | bytes, key: str = "k") -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_tiny_front_routes_by_prefix_and_passes_answers_through(tiny_front):
    server, state, _ = tiny_front
    shared = "the quick brown fox jumps over the lazy dog " * 4
    bodies = [{"model": MODEL, "prompt": shared + tail, "max_tokens": 2} for tail in ("a", "b", "c")]
    answers = [post(server.url, "/v1/completions", body) for body in bodies]
    assert [status for status, _ in answers] == [200, 200, 200]
    assert all(json.loads(body)["usage"]["completion_tokens"] == 2 for _, body in answers)
    assert sorted((r.num_routed, r.num_prefix_hits) for r in state.replicas) == [(0, 0), (3, 2)]
    stream = {**bodies[0], "stream": True, "stream_options": {"include_usage": True}}
    status, streamed = post(server.url, "/v1/completions", stream)
    events = streamed.decode().split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: "))["usage"]["completion_tokens"] == 2
    # the client's errors come back from the replica with their status and body
    status, body = post(server.url, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, body = post(server.url, "/v1/completions", b"[1, 2")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    assert post(server.url, "/v1/completions", bodies[0], key="wrong")[0] == 401
    assert post(server.url, "/v1/completions", {**bodies[0], "prompt": "x" * 5000})[0] == 413  # the front's limit
    plain = urllib.request.Request(
        server.url + "/v1/completions", data=b"{}", headers={"Authorization": "Bearer k", "Content-Type": "text/plain"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(plain, timeout=30)
    assert refused.value.code == 415
    assert all(r.num_in_flight == 0 and r.num_failed == 0 for r in state.replicas)


def test_tiny_front_skips_a_replica_that_refuses_and_reports_it(tiny_front):
    server, state, replica_servers = tiny_front
    replica_servers[0].__exit__(None, None, None)  # the first replica stops listening
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
    assert [post(server.url, "/v1/completions", body)[0] for _ in range(3)] == [200, 200, 200]
    first, second = state.replicas
    assert (first.is_healthy, first.num_failed, second.is_healthy, second.num_routed) == (False, 1, True, 3)
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        states = [r["state"] for r in json.loads(response.read())["replicas"]]
    assert states == ["unhealthy", "healthy"]
    replica_servers[1].__exit__(None, None, None)
    status, answer = post(server.url, "/v1/completions", body)
    assert status == 503 and json.loads(answer)["error"]["code"] == "unavailable"


class BreakingReplica(socketserver.ThreadingTCPServer):
    """A replica that answers /health, then breaks every answer halfway: a stream after its first event, a whole
    answer after 10 of its 100 announced bytes."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _BreakingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _BreakingHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request_line = self.rfile.readline().decode()
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = self.rfile.read(length)
        if request_line.startswith("GET /health"):
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        elif b'"stream": true' in body:
            event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            self.wfile.write(head + b"%x\r\n" % len(event) + event + b"\r\n")
            self.wfile.flush()
            time.sleep(0.3)  # as a replica dying mid-stream: the first event went out well before
        else:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        self.wfile.flush()


def test_a_replica_breaking_mid_answer_fails_that_request_clearly(tokenizer):
    broken = BreakingReplica()
    replicas = [Replica(broken.url)]
    wait_until_ready(replicas, timeout_s=10)
    state = Front(replicas, Router("round_robin"), PromptKeyer(tokenizer, 4, 4), health_interval_s=60)
    with LiveServer(build_front_app(state, ServeConfig())) as server:
        status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True})
        events = [e for e in body.decode().split("\n\n") if e]
        assert status == 200 and events[0] == 'data: {"choices": [{"index": 0, "text": "a"}]}'
        error = json.loads(events[1].removeprefix("data: "))["error"]
        assert error["code"] == "replica_failed" and "failed while answering" in error["message"]
        assert events[2:] == ["data: [DONE]"]
        assert (replicas[0].is_healthy, replicas[0].num_failed, replicas[0].num_in_flight) == (False, 1, 0)
        replicas[0].is_healthy = True  # let the non-streamed request reach it as well
        status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert status == 502 and json.loads(body)["error"]["code"] == "replica_failed"
        assert (replicas[0].num_failed, replicas[0].num_in_flight) == (2, 0)
        status, body = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert status == 503 and "no replica is in rotation" in json.loads(body)["error"]["message"]
    broken.shutdown()
    broken.server_close()


@contextlib.contextmanager
def stub_replicas(*names: str):
    """Stub replica processes (tests/fleet/stub_replica.py), one per name; yields (processes, urls)."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tests.fleet.stub_replica"]
    processes = [subprocess.Popen([*command, name], cwd=root, stdout=subprocess.PIPE, text=True) for name in names]
    try:
        yield processes, [f"http://127.0.0.1:{int(p.stdout.readline())}" for p in processes]
    finally:
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()
            process.stdout.close()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after 30 s")
        time.sleep(0.02)


def stall_front(tokenizer, urls: list[str], read_timeout_s: float = 60, health_interval_s: float = 0.2) -> Front:
    replicas = [Replica(url) for url in urls]
    wait_until_ready(replicas, timeout_s=10)
    router = Router("round_robin")  # the first request goes to the first replica
    return Front(replicas, router, PromptKeyer(tokenizer, 4, 4), health_interval_s, read_timeout_s, 0.5)


def test_a_stalled_replica_hands_its_unanswered_requests_to_another(tokenizer):
    """SIGSTOP (alive, silent) while a whole answer is pending: the health checks take the replica out, and the
    request is answered by the other replica; the client never sees the stall."""
    with stub_replicas("first", "second") as (processes, urls):
        state = stall_front(tokenizer, urls)
        first, second = state.replicas
        with LiveServer(build_front_app(state, ServeConfig())) as server, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, server.url, "/v1/completions", {"model": MODEL, "prompt": "hold:first"})
            wait_for(lambda: first.num_in_flight == 1, "sent to the first replica")
            os.kill(processes[0].pid, signal.SIGSTOP)
            status, body = pending.result(timeout=60)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "second"
        assert (first.is_healthy, first.num_failed, first.num_in_flight) == (False, 1, 0)
        assert (second.num_routed, second.num_in_flight) == (1, 0)


def test_a_stalled_replica_fails_a_started_stream_and_a_request_nobody_else_can_take(tokenizer):
    """One replica: a stream it has started ends with an `error` event; a whole answer it stalls on gets a 504 JSON
    error (no replica left to take it)."""
    with stub_replicas("only") as (processes, urls):
        state = stall_front(tokenizer, urls)
        (only,) = state.replicas
        with LiveServer(build_front_app(state, ServeConfig())) as server:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            body = json.dumps({"model": MODEL, "prompt": "hold:only", "stream": True})
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200
            assert json.loads(response.readline().removeprefix(b"data: "))["choices"][0]["text"] == "only"
            os.kill(processes[0].pid, signal.SIGSTOP)
            events = [e.strip() for e in response.read().decode().split("\n\n") if e.strip()]
            connection.close()
            error = json.loads(events[0].removeprefix("data: "))["error"]
            assert error["code"] == "replica_timeout" and "stalled" in error["message"]
            assert events[1:] == ["data: [DONE]"]
            assert only.num_in_flight == 0 and not only.is_healthy

            os.kill(processes[0].pid, signal.SIGCONT)
            wait_for(lambda: only.is_healthy, "back in rotation")
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(post, server.url, "/v1/completions", {"model": MODEL, "prompt": "hold:only"})
                wait_for(lambda: only.num_in_flight == 1, "sent to the replica")
                os.kill(processes[0].pid, signal.SIGSTOP)
                status, answer = pending.result(timeout=60)
            error = json.loads(answer)["error"]
            assert status == 504 and error["code"] == "replica_timeout"
            assert "no other replica is in rotation" in error["message"] and only.num_in_flight == 0


def test_the_read_timeout_bounds_a_silent_replica(tokenizer):
    """No health checks here (one a minute): --replica-read-timeout-s alone ends the wait, with a 504; and /v1/models
    waits on a stalled replica no longer than a health check would."""
    with stub_replicas("only") as (processes, urls):
        state = stall_front(tokenizer, urls, read_timeout_s=1, health_interval_s=60)
        with LiveServer(build_front_app(state, ServeConfig())) as server:
            status, answer = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hold:only"})
            error = json.loads(answer)["error"]
            assert status == 504 and error["code"] == "replica_timeout"
            assert "--replica-read-timeout-s 1" in error["message"]
            assert (state.replicas[0].num_failed, state.replicas[0].num_in_flight) == (1, 0)
        patient = stall_front(tokenizer, urls, read_timeout_s=600, health_interval_s=60)
        with LiveServer(build_front_app(patient, ServeConfig())) as server:
            os.kill(processes[0].pid, signal.SIGSTOP)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(server.url + "/v1/models", timeout=30)
            assert refused.value.code == 503 and not patient.replicas[0].is_healthy


def test_health_and_metrics_show_no_credentials_or_pids(tokenizer):
    """/health answers without a key; neither it nor /metrics may show a --replicas URL's password or token, nor
    a local replica's pid."""
    with stub_replicas("remote", "local") as (processes, urls):
        port = urls[0].rsplit(":", 1)[1]
        remote = Replica(f"http://alice:s3cret@127.0.0.1:{port}/base?token=t0ken", is_healthy=True)
        local = Replica(urls[1], process=processes[1], is_healthy=True)
        state = Front([remote, local], Router("round_robin"), PromptKeyer(tokenizer, 4, 4), health_interval_s=60)
        with LiveServer(build_front_app(state, ServeConfig())) as server:
            with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
                health = json.loads(response.read())
            with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
                metrics = response.read().decode()
    assert [r["url"] for r in health["replicas"]] == [f"http://127.0.0.1:{port}", urls[1]]
    assert all("pid" not in r for r in health["replicas"])
    for page in (json.dumps(health), metrics):
        assert "s3cret" not in page and "alice" not in page and "t0ken" not in page
        assert str(processes[1].pid) not in page
    assert f'leanlm_router_replica_healthy{{replica="http://127.0.0.1:{port}"}} 1.0' in metrics


def test_nested_json_and_huge_counts_get_the_servers_own_400_before_keying(tiny_front):
    """The front answers what the replica alone would (same status, same JSON), before the keyer sees the body:
    nesting past the parser's bound (json.loads raised RecursionError: a plain-text 500), more messages or prompts
    than the server's schema takes."""
    _, state, (one, _) = tiny_front
    keyed = []
    key = state.keyer.key
    state.keyer.key = lambda path, body: keyed.append(path) or key(path, body)
    with LiveServer(build_front_app(state, ServeConfig(api_key="k", max_body_bytes=1 << 20))) as server:
        nested = b'{"model": "%s", "messages": %s}' % (MODEL.encode(), b"[" * 5000 + b"]" * 5000)
        many = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 2049}
        prompts = {"model": MODEL, "prompt": ["a"] * 1025}
        for path, body in (
            ("/v1/chat/completions", nested),
            ("/v1/chat/completions", many),
            ("/v1/completions", prompts),
        ):
            status, answer = post(server.url, path, body)
            alone_status, alone = post(one.url, path, body)
            assert status == alone_status == 400
            assert json.loads(answer) == json.loads(alone)
        assert keyed == []
        assert post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 1})[0] == 200
        assert keyed == ["/v1/completions"]  # a good body is keyed as before


# ---------------------------------------------------------------------- real: SmolLM2 replica processes


@pytest.mark.real_model
def test_chat_completion_and_streams_pass_through(client):
    model = client.models.list().data[0].id
    assert model == DEFAULT_MODEL
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    answer = client.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(choice.delta.content or "" for c in chunks for choice in c.choices)
    assert streamed == answer.choices[0].message.content  # greedy: the same text from either replica
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens == 5
    pieces = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True
    )
    assert "".join(choice.text for p in pieces for choice in p.choices) == completion.choices[0].text
    embedded = client.embeddings.create(model=model, input=["one", "two"])  # routed like any request
    assert [len(d.embedding) for d in embedded.data] == [576, 576] and embedded.usage.prompt_tokens == 2


@pytest.mark.real_model
def test_auth_and_bad_requests_get_their_errors(front, client):
    wrong = openai.OpenAI(base_url=front.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # the replica's 404, passed through
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=2, temperature=-1)
    request = urllib.request.Request(
        front.url + "/v1/completions",
        data=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400
    assert "not valid JSON" in json.loads(refused.value.read())["error"]["message"]
    status, body = get(front, "/health")
    assert status == 200 and [r["state"] for r in json.loads(body)["replicas"]] == ["healthy", "healthy"]


@pytest.mark.real_model
def test_same_prefix_goes_to_the_same_replica(front, client):
    before = routed(front)
    for question in ("Do you sell rye?", "When do you open?", "Is there coffee?"):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=chat(SYSTEM["support"], question), max_tokens=2)
    middle = routed(front)
    client.chat.completions.create(model=DEFAULT_MODEL, messages=chat(SYSTEM["weather"], "Rain?"), max_tokens=2)
    after = routed(front)
    grew = {url: (middle[url][0] - before[url][0], middle[url][1] - before[url][1]) for url in before}
    assert sorted(grew.values()) == [(0, 0), (3, 2)]  # all three on one replica; the 2nd and 3rd were hits
    support = next(url for url, (n, _) in grew.items() if n == 3)
    # a new prefix goes to the replica that holds fewer blocks: the other one
    assert {url: after[url][0] - middle[url][0] for url in after} == {url: float(url != support) for url in after}
    page = get(front, "/metrics")[1]
    assert f'leanlm_prefix_cache_hit_rate{{model_name="{DEFAULT_MODEL}",replica="{support}"}}' in page
    rate = float(
        page.split(f'leanlm_prefix_cache_hit_rate{{model_name="{DEFAULT_MODEL}",replica="{support}"}} ')[1].split()[0]
    )
    assert rate > 0  # the replica's own prefix cache served the shared system prompt


@pytest.mark.real_model
def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(front, client):
    before = routed(front)
    client.chat.completions.create(model=DEFAULT_MODEL, messages=chat(SYSTEM["kill"], "Hello"), max_tokens=1)
    victim = next(url for url, (n, _) in routed(front).items() if n > before[url][0])
    # /health shows no pids (it answers without a key): the victim is the front's child serving on its port
    port = victim.rsplit(":", 1)[1]
    children = [child.cmdline() + [str(child.pid)] for child in psutil.Process(front.process.pid).children()]
    pid = next(int(line[-1]) for line in children if line[line.index("--port") + 1] == port)
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=chat(SYSTEM["kill"], "Tell a long story."), max_tokens=300, stream=True
    )
    first = next(iter(stream))  # the stream has started on the victim (same prefix, loads equal)
    assert first.choices[0].delta.role == "assistant"
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="failed while answering"):
        for _ in stream:
            pass
    # the other replica takes everything now, including the victim's prefix
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=chat(SYSTEM["kill"], "Hi"), max_tokens=3)
    assert answer.usage.completion_tokens == 3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the health check reports the dead process
        replicas = json.loads(get(front, "/health")[1])["replicas"]
        if any(r["state"] == "dead" for r in replicas):
            break
        time.sleep(0.2)
    states = {r["url"]: r["state"] for r in replicas}
    assert states[victim] == "dead" and list(states.values()).count("healthy") == 1
    assert next(r for r in replicas if r["url"] == victim)["exit_status"] == -signal.SIGKILL
    page = get(front, "/metrics")[1]
    assert f'leanlm_router_request_failures_total{{replica="{victim}"}} 1.0' in page
    assert f'leanlm_router_replica_healthy{{replica="{victim}"}} 0.0' in page
    counts = routed(front)
    with ThreadPoolExecutor(3) as pool:
        calls = [
            pool.submit(client.completions.create, model=DEFAULT_MODEL, prompt=f"Hi {i}", max_tokens=2)
            for i in range(3)
        ]
        assert [call.result().usage.completion_tokens for call in calls] == [2, 2, 2]
    assert {url: n - counts[url][0] for url, (n, _) in routed(front).items()} == {
        url: 0.0 if url == victim else 3.0 for url in counts
    }
