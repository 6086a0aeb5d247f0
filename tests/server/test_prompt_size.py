"""Big prompts against a real server (issue 34, item 5): a text prompt longer than the context can hold is refused
before it is tokenized, one just under that cap is tokenized while /health keeps answering, the preparation queue
is bounded, and a client that hangs up while queued has its preparation dropped."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import aiohttp
import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.engine import LLMEngine
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict
from tests.server.conftest import MODEL, serve_engine
from tests.server.test_safety import _engine_is_idle, tiny_engine_factory  # noqa: F401

CONTEXT = 8192  # SmolLM2's


@pytest.fixture
def real_tokenizer_engine(real_tokenizer):
    """A tiny random model over the real SmolLM2 tokenizer, with SmolLM2's context (the model never runs here)."""
    config = dataclasses.replace(tiny_config(real_tokenizer.vocab_size), max_position_embeddings=CONTEXT)
    model = build_model(config, tiny_state_dict(config), torch.float32)
    return LLMEngine(
        model, real_tokenizer, EngineConfig(kv_cache_memory_bytes=32 << 20), torch.device("cpu"), torch.float32
    )


def _text(num_chars: int) -> str:
    words = "the quick brown fox jumps over a lazy dog while 12 clocks tick in Paris, Berlin and Rome; ".split(" ")
    pieces, total, i = [], 0, 0
    while total < num_chars:
        word = f"{words[i % len(words)]}{i % 97} "
        pieces.append(word)
        total += len(word)
        i += 1
    return "".join(pieces)[:num_chars]


async def _poll_health(session: aiohttp.ClientSession, url: str, done: asyncio.Event) -> list[float]:
    waits = []
    while not done.is_set():
        start = time.monotonic()
        async with session.get(url + "/health") as resp:
            assert resp.status == 200
        waits.append(time.monotonic() - start)
        await asyncio.sleep(0.05)
    return waits


def test_a_16_mib_prompt_is_refused_before_tokenizing_and_health_stays_fast(real_tokenizer_engine):
    huge = _text(16 << 20)
    longest_token = max(map(len, real_tokenizer_engine.tokenizer.backend.get_vocab(with_added_tokens=True)))
    serving_cap = CONTEXT * longest_token  # the default cap: past it a text has more tokens than the context
    under_cap = _text(serving_cap - 16)  # tokenized for real: about 150k tokens, more than the context

    async def scenario(url: str):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

            async def post(prompt: str):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    return resp.status, await resp.json()

            done = asyncio.Event()
            health = asyncio.ensure_future(_poll_health(session, url, done))
            await asyncio.sleep(0.2)
            results = await asyncio.gather(post(huge), post(huge), post(huge), post(under_cap))
            done.set()
            return results, await health

    with serve_engine(real_tokenizer_engine, max_body_bytes=40 << 20) as server:
        results, waits = asyncio.run(scenario(server.url))
        assert _engine_is_idle(server.engine)
    assert max(waits) < 1.0, f"/health took up to {max(waits):.2f} s while big prompts were prepared ({waits})"
    for status, body in results[:3]:
        assert status == 400, body
        assert body["error"]["code"] == "context_length_exceeded"
        assert f"more than the {serving_cap} this server tokenizes" in body["error"]["message"]
        assert "shorten the prompt" in body["error"]["message"]
    status, body = results[3]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "the prompt has" in body["error"]["message"] and "tokens" in body["error"]["message"]  # it was tokenized


def test_a_chat_longer_than_the_cap_is_refused_before_rendering(tiny_engine_factory):
    engine = tiny_engine_factory()
    rendered = []
    real_render = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = lambda *a, **kw: rendered.append(1) or real_render(*a, **kw)
    with serve_engine(engine, max_prompt_chars=1000) as server:
        from tests.server.test_safety import _request

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1001}], "max_tokens": 1}
        status, _, body = _request(server.url, "/v1/chat/completions", chat)
        assert status == 400 and body["error"]["param"] == "messages", body
        assert "1001 characters" in body["error"]["message"]
        assert rendered == []
        chat["messages"][0]["content"] = "x" * 995  # fits, but the template's markers make it longer than 1000
        status, _, body = _request(server.url, "/v1/chat/completions", chat)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert "shorten the messages" in body["error"]["message"]


def _blocking_render(engine, release: threading.Event, started: list[str]):
    real_render = engine.tokenizer.apply_chat_template

    def render(messages, *args, **kwargs):
        started.append(messages[0]["content"])
        release.wait(30)
        return real_render(messages, *args, **kwargs)

    engine.tokenizer.apply_chat_template = render


def _chat(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


async def _post_chat(session: aiohttp.ClientSession, url: str, content: str) -> tuple[int, str | None, dict]:
    """(status, Retry-After, body) of a one-message chat request."""
    async with session.post(url + "/v1/chat/completions", json=_chat(content)) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.json()


def test_a_client_that_hangs_up_has_its_queued_preparation_dropped(tiny_engine_factory):
    engine = tiny_engine_factory()
    release, started = threading.Event(), []
    _blocking_render(engine, release, started)

    async def scenario(url: str):
        async with aiohttp.ClientSession() as session:
            busy = [asyncio.ensure_future(_post_chat(session, url, f"busy{i}")) for i in range(2)]  # both blocked
            while len(started) < 2:
                await asyncio.sleep(0.02)
            queued = asyncio.ensure_future(_post_chat(session, url, "hung-up"))
            await asyncio.sleep(0.3)  # queued behind them now
            queued.cancel()  # the client hangs up
            await asyncio.sleep(0.3)
            release.set()
            statuses = [status for status, _, _ in await asyncio.gather(*busy)]
            await asyncio.sleep(0.3)
            return statuses

    with serve_engine(engine) as server:
        statuses = asyncio.run(scenario(server.url))
        assert statuses == [200, 200]
        assert started == ["busy0", "busy1"]  # the hung-up request was never rendered
        assert server.app.state.serving.num_pending_prepares == 0
        assert _engine_is_idle(server.engine)


def test_the_preparation_queue_is_bounded(tiny_engine_factory):
    engine = tiny_engine_factory()
    release, started = threading.Event(), []
    _blocking_render(engine, release, started)

    async def scenario(url: str):
        async with aiohttp.ClientSession() as session:
            busy = [asyncio.ensure_future(_post_chat(session, url, f"busy{i}")) for i in range(2)]
            while len(started) < 2:
                await asyncio.sleep(0.02)
            refused = await _post_chat(session, url, "one too many")
            release.set()
            return refused, await asyncio.gather(*busy)

    with serve_engine(engine, max_pending_prepares=2) as server:
        (status, retry_after, body), busy = asyncio.run(scenario(server.url))
    assert status == 429 and retry_after == "1", body
    assert "retry later" in body["error"]["message"]
    assert [s for s, _, _ in busy] == [200, 200]
