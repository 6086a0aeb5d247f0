"""The OpenAI server on a tensor-parallel engine: the single server's client checks pass unchanged through it, and
`leanlm serve --tensor-parallel-size 2` exits 1, failing its in-flight requests, when a rank dies."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from leanlm import LLM
from tests.server import test_openai_client as server_checks
from tests.server.conftest import MODEL, serve_engine
from tests.server.test_lifecycle import _free_port, _wait_healthy

pytestmark = pytest.mark.real_model

CHECKS = [getattr(server_checks, name) for name in dir(server_checks) if name.startswith("test_")]


@pytest.fixture(scope="module")
def tp_llm():
    with LLM(MODEL, dtype="float32", kv_cache_memory_bytes=256 << 20, progress=False, tensor_parallel_size=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp_client(tp_llm):
    openai = pytest.importorskip("openai")
    with serve_engine(tp_llm.llm_engine) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_the_server_checks_pass_on_a_tensor_parallel_engine(check, tp_client, tp_llm):
    given = {"openai_client": tp_client, "real_llm": tp_llm}
    check(**{name: given[name] for name in inspect.signature(check).parameters})


def test_serve_exits_1_when_a_rank_dies():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "leanlm.cli", "serve", "--model", MODEL, "--port", str(port)]
    command += ["--tensor-parallel-size", "2", "--kv-cache-memory-bytes", str(64 << 20)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(url, proc)
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert first.choices[0].text
        (worker,) = psutil.Process(proc.pid).children()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError):
            client.completions.create(model=MODEL, prompt="Hello again", max_tokens=4)
        assert proc.wait(timeout=60) == 1
        assert time.monotonic() - started < 60
        assert "exited" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()


def test_tp2_x_dp2_serves_the_one_process_greedy_answers():
    """Two replicas, each a TP=2 engine (4 ranks), behind the front: the one-process float32 text and logprobs."""
    from leanlm import SamplingParams
    from leanlm.analysis.peers import leanlm_server

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    with LLM(MODEL, dtype="float32", progress=False) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, logprobs=0), use_tqdm=False)
    want = [(o.outputs[0].text, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]
    flags = "--data-parallel-size 2 --tensor-parallel-size 2 --threads 1 --dtype float32 --num-kv-blocks 64"
    server = leanlm_server(MODEL, _free_port(), tuple(flags.split()))
    server.startup_timeout_s = 300
    openai = pytest.importorskip("openai")
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, (text, logprobs) in zip(prompts, want):
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0, logprobs=0)
            assert got.choices[0].text == text
            assert max(abs(a - b) for a, b in zip(got.choices[0].logprobs.token_logprobs, logprobs)) < 1e-4
