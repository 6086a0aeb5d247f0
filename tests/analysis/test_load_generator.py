"""The load generator against a real (stub) streaming HTTP server: counts, timings, errors, concurrency, schedule."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import signal
import socket
import statistics
import time

import pytest

from leanlm.analysis import load_generator
from leanlm.analysis.load_generator import (
    LoadConfig,
    _Trace,
    arrival_offsets,
    prompts_from_file,
    prompts_from_text,
    request_payload,
    run_load_sync,
    split_events,
)
from tests.analysis.stub_server import MODEL_ID


def spec(**kwargs) -> str:
    return json.dumps(kwargs)


def run(url: str, prompts: list[str], **kwargs):
    kwargs.setdefault("num_requests", len(prompts))
    kwargs.setdefault("model", MODEL_ID)
    return run_load_sync(LoadConfig(url=url, **kwargs), prompts, progress=False)


# ------------------------------------------------------------------------------------------- against the stub


def test_counts_tokens_and_times_every_chunk(stub):
    url, state = stub
    result = run(url, [spec(ttft=0.03, itl=0.01, tokens_per_chunk=2)], num_requests=8, output_len=6)
    assert (result.num_completed, result.num_failed) == (8, 0)
    assert result.total_output_tokens == 48
    assert result.total_input_tokens == 8 * len(spec(ttft=0.03, itl=0.01, tokens_per_chunk=2).split())
    for r in result.records:
        assert r.is_usage_reported and r.num_output_tokens == 6
        assert r.text == "tok " * 6
        assert len(r.chunk_s) == 3  # 6 tokens, 2 per chunk
        assert r.ttft_s >= 0.03
        assert all(gap >= 0.009 for gap in r.itls_s)
        assert r.send_s <= r.chunk_s[0] <= r.chunk_s[-1] <= r.end_s
        assert r.tpot_s == pytest.approx((r.chunk_s[-1] - r.chunk_s[0]) / 5)
    assert result.ttft.count == 8 and result.ttft.p50 >= 30
    assert result.itl.count == 16 and result.itl.p50 >= 9
    assert result.ttft.p50 < result.e2e_latency.p50
    assert result.output_throughput == pytest.approx(48 / result.duration_s)
    assert result.request_throughput == pytest.approx(8 / result.duration_s)


def test_ttft_follows_the_server_delay_per_request(stub):
    url, _ = stub
    prompts = [spec(ttft=0.12), spec(ttft=0.0), spec(ttft=0.06)]
    result = run(url, prompts, output_len=2)
    ttfts = {r.prompt_idx: r.ttft_s for r in result.records}
    assert ttfts[1] < ttfts[2] < ttfts[0]
    assert ttfts[0] >= 0.12 and ttfts[2] >= 0.06


def test_errors_are_recorded_not_raised(stub):
    url, _ = stub
    prompts = ["fine", spec(fail="http"), spec(fail="stream"), spec(fail="truncate")]
    result = run(url, prompts, output_len=3)
    assert (result.num_completed, result.num_failed) == (1, 3)
    errors = {r.prompt_idx: r.error for r in result.records}
    assert errors[0] is None
    assert errors[1].startswith("HTTP 503") and "overloaded" in errors[1]
    assert errors[2] == "server error: boom"
    assert "[DONE]" in errors[3]
    assert result.total_output_tokens == 3  # only the successful request counts


def test_slow_requests_time_out(stub):
    url, _ = stub
    result = run(url, [spec(ttft=2.0), "fast"], output_len=2, timeout_s=0.3)
    errors = {r.prompt_idx: r.error for r in result.records}
    assert errors == {0: "timed out after 0.3 s", 1: None}


def test_unreachable_server_fails_every_request():
    with socket.socket() as sock:  # a port nobody listens on once this closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run(f"http://127.0.0.1:{port}", ["a"], num_requests=3, output_len=2)
    assert result.num_failed == 3 and all("Connect" in e for e in result.errors)
    assert math.isnan(result.ttft.p50)


def test_without_usage_counts_chunks(stub):
    url, _ = stub
    result = run(url, [spec(usage=False, tokens_per_chunk=2, crlf=True)], output_len=6)
    (record,) = result.records
    assert record.is_success and not record.is_usage_reported
    assert record.num_output_tokens == 3 and record.num_prompt_tokens is None


def test_concurrency_cap_is_respected(stub):
    url, state = stub
    prompts = [spec(ttft=0.15, itl=0.005)]  # long enough that every stream allowed in is open at once
    capped = run(url, prompts, num_requests=9, max_concurrency=3, output_len=3)
    assert capped.num_completed == 9 and state.max_active == 3
    assert capped.duration_s > 3 * 0.15  # three waves of three
    state.reset()
    uncapped = run(url, prompts, num_requests=12, output_len=3)
    assert uncapped.num_completed == 12 and state.max_active == 12


def test_request_carries_model_auth_usage_and_eos_bias(stub):
    url, state = stub
    config = LoadConfig(url=url + "/", num_requests=2, output_len=4, api_key="sekret", eos_token_ids=(2, 0))
    result = run_load_sync(config, ["hello world"], progress=False)
    assert result.model == MODEL_ID  # asked /v1/models, since config.model is None
    assert state.authorizations == ["Bearer sekret"] * 2
    payload = state.payloads[0]
    assert payload == request_payload(config, MODEL_ID, "hello world")
    assert payload["logit_bias"] == {"2": -100, "0": -100}
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == 4 and payload["temperature"] == 0.0
    assert "logit_bias" not in request_payload(LoadConfig(), "m", "p")


def test_sends_follow_the_poisson_schedule(stub):
    url, _ = stub
    result = run(url, ["x"], num_requests=10, request_rate=20.0, seed=3, output_len=1)
    offsets = arrival_offsets(10, 20.0, 3)  # spans about 0.3 s
    for record, offset in zip(result.records, offsets):
        assert offset - 1e-3 <= record.send_s <= offset + 0.08


# -------------------------------------------------------------------------------------------------- pure parts


def test_arrival_offsets_are_seeded_exponential_gaps():
    offsets = arrival_offsets(20_000, 50.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: stdev equals mean
    assert arrival_offsets(100, 50.0, seed=1) == offsets[:100]
    assert arrival_offsets(100, 50.0, seed=2) != offsets[:100]
    assert arrival_offsets(4, math.inf, seed=1) == [0.0] * 4


def test_split_events_handles_crlf_comments_multiline_and_partial_events():
    events, rest = split_events(b': ping\r\n\r\ndata: {"a": 1}\r\n\r\ndata: x\ndata: y\n\nevent: e\n\ndata: [DO')
    assert events == ['{"a": 1}', "x\ny"]
    assert rest == b"data: [DO"
    events, rest = split_events(rest + b"NE]\n\n")
    assert events == ["[DONE]"] and rest == b""


@pytest.mark.parametrize("data", ["not json", "[1, 2]"])
def test_malformed_events_fail_the_request(data):
    trace = _Trace(prompt_idx=0, send_s=0.0)
    trace.read(data, now_s=0.1)
    assert trace.record(end_s=0.2).error.startswith("malformed event data")


class WordTokenizer:
    """Whitespace words <-> ids: enough to cut prompts."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


def test_prompts_are_consecutive_non_overlapping_pieces(tmp_path):
    text = " ".join(f"w{i}" for i in range(1000))
    tokenizer = WordTokenizer()
    prompts = prompts_from_text(text, tokenizer, num_prompts=5, input_len=7)
    assert prompts[0] == " ".join(f"w{i}" for i in range(7))
    assert prompts[4] == " ".join(f"w{i}" for i in range(28, 35))
    (tmp_path / "t.txt").write_text(text)
    assert prompts_from_file(tmp_path / "t.txt", tokenizer, 5, 7) == prompts
    with pytest.raises(ValueError, match="fewer requests or a shorter input length"):
        prompts_from_text(text, tokenizer, num_prompts=11, input_len=100)
    with pytest.raises(ValueError, match="does not exist"):
        prompts_from_file(tmp_path / "missing.txt", tokenizer, 5, 7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"url": "localhost:8000"}, "must start with http"),
        ({"num_requests": 0}, "num_requests must be at least 1"),
        ({"output_len": 0}, "output_len must be at least 1"),
        ({"request_rate": 0.0}, "request_rate must be > 0"),
        ({"request_rate": math.nan}, "request_rate must be > 0"),
        ({"max_concurrency": 0}, "max_concurrency must be at least 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"timeout_s": 0.0}, "timeout_s must be > 0"),
        ({"eos_token_ids": (-1,)}, "eos_token_ids"),
    ],
)
def test_config_rejects_bad_values_with_a_hint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadConfig(**kwargs)


# ------------------------------------------------------------------------------------------------ Ctrl-C


async def _interrupt_then_wait(swallow: bool) -> None:
    """Send this process SIGINT once running, then wait; with `swallow`, ignore the cancellation that follows
    (as an HTTP client can, deep in a request) and go on waiting."""
    asyncio.get_running_loop().call_later(0.05, signal.raise_signal, signal.SIGINT)
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not swallow:
                raise


@pytest.mark.parametrize("swallow", [False, True], ids=["cancel-honoured", "cancel-swallowed"])
def test_ctrl_c_ends_the_run_even_when_a_task_ignores_its_cancellation(monkeypatch, capfd, swallow):
    monkeypatch.setattr(load_generator, "INTERRUPT_GRACE_S", 0.3)
    monkeypatch.setattr(load_generator, "run_load", lambda config, prompts, progress: _interrupt_then_wait(swallow))
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_load_sync(LoadConfig(url="http://127.0.0.1:1", model=MODEL_ID), ["x"], progress=False)
    elapsed = time.perf_counter() - start
    # honoured: ends as soon as the task does; swallowed: abandoned after the grace period, not an hour later
    assert (elapsed < 0.3) if not swallow else (0.3 <= elapsed < 5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    gc.collect()  # the abandoned task is dropped here, and says nothing
    assert capfd.readouterr().err == ""
