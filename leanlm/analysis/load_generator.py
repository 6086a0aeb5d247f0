"""Client side of the serving benchmark: Poisson-arrival load against any OpenAI-compatible completions server.

Each request is `POST {url}/v1/completions` with `stream: true`; we time the first and every later content
chunk of the server-sent events, in the spirit of vLLM's benchmark_serving.py. `load_report` summarises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
from tqdm.auto import tqdm

from leanlm.analysis.load_report import LoadResult, RequestRecord


@dataclass(frozen=True)
class LoadConfig:
    """One load run. Every request asks for `output_len` tokens; arrivals follow a seeded Poisson process."""

    url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "base URL of the server; requests go to URL/v1/completions"}
    )
    model: str | None = field(
        default=None, metadata={"help": "model name sent in each request (default: the first id of GET /v1/models)"}
    )
    num_requests: int = field(default=100, metadata={"help": "requests to send"})
    request_rate: float = field(
        default=math.inf,
        metadata={"help": "mean arrivals per second (a seeded Poisson process); inf sends all at once"},
    )
    max_concurrency: int | None = field(
        default=None, metadata={"help": "most requests in flight at once (client-side; default: no cap)"}
    )
    output_len: int = field(default=128, metadata={"help": "max_tokens of every request"})
    temperature: float = field(
        default=0.0,
        metadata={"help": "sampling temperature; 0 is greedy, so runs against two servers ask for the same work"},
    )
    seed: int = field(default=0, metadata={"help": "seeds the arrival schedule"})
    api_key: str | None = field(default=None, metadata={"help": "sent as `Authorization: Bearer KEY` when given"})
    # Token ids that end generation. Each gets `logit_bias` -100 so that every request generates exactly
    # `output_len` tokens on servers that honour logit_bias; the tokens received are counted regardless.
    # (`leanlm bench serve` derives them from --tokenizer and --ignore-eos: no flag of its own.)
    eos_token_ids: tuple[int, ...] = field(
        default=(), metadata={"help": "token ids given logit_bias -100 so every request makes output_len tokens"}
    )
    timeout_s: float = field(
        default=600.0, metadata={"help": "seconds after which an unfinished request is recorded as failed"}
    )

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}; e.g. http://127.0.0.1:8000")
        for name in ("num_requests", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.request_rate > 0:  # also rejects NaN
            raise ValueError(f"request_rate must be > 0 requests/s (inf sends all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, or None for no cap; got {self.max_concurrency}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if any(not isinstance(i, int) or i < 0 for i in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative token ids, got {self.eos_token_ids!r}")

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/") + "/v1/completions"


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


# ------------------------------------------------------------------------------------------------ prompts


def prompts_from_text(text: str, tokenizer: TextTokenizer, num_prompts: int, input_len: int) -> list[str]:
    """`num_prompts` non-overlapping consecutive pieces of `text`, each `input_len` tokens before decoding.

    Re-encoding a decoded piece can merge differently at its edges, so prompts are *about* `input_len`
    tokens; the server's `usage.prompt_tokens` reports the exact count. Non-overlapping pieces give a
    prefix cache nothing to reuse, so both servers do the full prefill.
    """
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"num_prompts and input_len must be at least 1, got {num_prompts} and {input_len}")
    needed = num_prompts * input_len
    budget = needed * 8 + 4096  # characters: English BPE averages ~4-5 per token, so one encode usually suffices
    ids = tokenizer.encode(text[:budget])
    if len(ids) < needed and budget < len(text):
        ids = tokenizer.encode(text)
    if len(ids) < needed:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than {num_prompts} prompts x {input_len} tokens; "
            "use a longer text file, fewer requests or a shorter input length"
        )
    return [tokenizer.decode(ids[i * input_len : (i + 1) * input_len]) for i in range(num_prompts)]


def prompts_from_file(path: str | Path, tokenizer: TextTokenizer, num_prompts: int, input_len: int) -> list[str]:
    """`prompts_from_text` over a UTF-8 text file (e.g. WikiText-2 raw)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt data file {path} does not exist; pass an existing text file")
    return prompts_from_text(path.read_text(encoding="utf-8"), tokenizer, num_prompts, input_len)


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [0.0], 0.0
    for _ in range(num_requests - 1):
        now += rng.expovariate(request_rate)
        offsets.append(now)
    return offsets


# ------------------------------------------------------------------------------------------- one request


def request_payload(config: LoadConfig, model: str, prompt: str) -> dict:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": config.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.eos_token_ids:
        payload["logit_bias"] = {str(i): -100 for i in config.eos_token_ids}
    return payload


def split_events(buffer: bytes) -> tuple[list[str], bytes]:
    """Complete server-sent events in `buffer` -> (the data of each, the unfinished rest).

    An event ends at a blank line; its `data:` lines are joined with newlines; comment lines (`: ping`)
    and other fields are dropped, and events without data are skipped.
    """
    buffer = buffer.replace(b"\r\n", b"\n")
    *complete, rest = buffer.split(b"\n\n")
    events = []
    for raw in complete:
        lines = [line[5:].removeprefix(" ") for line in raw.decode("utf-8").split("\n") if line.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events, rest


@dataclass
class _Trace:
    """What one streamed response showed so far (mutable while reading; frozen into a RequestRecord)."""

    prompt_idx: int
    send_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with non-empty text
    text: list[str] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_usage_tokens: int | None = None  # usage.completion_tokens, when the server reported it
    is_done: bool = False  # saw `data: [DONE]`
    error: str | None = None

    def read(self, data: str, now_s: float) -> None:
        """Take in one event's data, which arrived `now_s` after the start."""
        if data == "[DONE]":
            self.is_done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            self.error = f"malformed event data: {data[:200]!r}"
            return
        if chunk.get("error"):
            error = chunk["error"]
            self.error = "server error: " + str(error.get("message", error) if isinstance(error, dict) else error)
            return
        text = "".join(choice.get("text") or "" for choice in chunk.get("choices") or [])
        if text:
            self.chunk_s.append(now_s)
            self.text.append(text)
        if usage := chunk.get("usage"):
            self.num_prompt_tokens = usage.get("prompt_tokens", self.num_prompt_tokens)
            self.num_usage_tokens = usage.get("completion_tokens", self.num_usage_tokens)

    def record(self, end_s: float) -> RequestRecord:
        if self.error is None and not self.is_done:
            self.error = "the stream closed before `data: [DONE]`"
        num_output = self.num_usage_tokens if self.num_usage_tokens is not None else len(self.chunk_s)
        return RequestRecord(
            prompt_idx=self.prompt_idx,
            send_s=self.send_s,
            chunk_s=tuple(self.chunk_s),
            end_s=end_s,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=num_output,
            is_usage_reported=self.num_usage_tokens is not None,
            text="".join(self.text),
            error=self.error,
        )


async def send_request(
    session: aiohttp.ClientSession, config: LoadConfig, payload: dict, prompt_idx: int, start: float
) -> RequestRecord:
    """Stream one completion; failures (HTTP status, error events, broken connections) become the record's error."""
    trace = _Trace(prompt_idx, time.perf_counter() - start)
    try:
        async with session.post(config.completions_url, json=payload) as response:
            if response.status != 200:
                trace.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return trace.record(time.perf_counter() - start)
            buffer = b""
            async for data in response.content.iter_any():
                now_s = time.perf_counter() - start  # every event in this read arrived together
                events, buffer = split_events(buffer + data)
                for event in events:
                    trace.read(event, now_s)
                if trace.error is not None or trace.is_done:
                    break
    except TimeoutError:
        trace.error = f"timed out after {config.timeout_s} s"
    except (aiohttp.ClientError, OSError, UnicodeDecodeError) as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
    return trace.record(time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------- a run


async def fetch_model_id(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists at GET /v1/models."""
    models_url = url.rstrip("/") + "/v1/models"
    try:
        async with session.get(models_url) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, TimeoutError, OSError, KeyError, IndexError, TypeError) as exc:
        raise ConnectionError(
            f"could not read a model id from {models_url} ({type(exc).__name__}: {exc}); "
            "is the server running? or name the model explicitly"
        ) from exc


async def run_load(config: LoadConfig, prompts: Sequence[str], progress: bool = True) -> LoadResult:
    """Send `config.num_requests` requests (request i uses prompts[i % len(prompts)]) and time them all."""
    if not prompts:
        raise ValueError("run_load needs at least one prompt")
    offsets = arrival_offsets(config.num_requests, config.request_rate, config.seed)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # limit=0: aiohttp's pool would otherwise cap us at 100 connections; only our semaphore may cap concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = config.model or await fetch_model_id(session, config.url)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
        bar = tqdm(total=config.num_requests, desc="requests", unit="req", disable=not progress)
        start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with gate:  # the send time is taken inside, so queueing here is not counted as latency
                idx = i % len(prompts)
                record = await send_request(session, config, request_payload(config, model, prompts[idx]), idx, start)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i) for i in range(config.num_requests)))
        duration_s = time.perf_counter() - start
        bar.close()
    return LoadResult(config=config, model=model, records=tuple(records), duration_s=duration_s)


INTERRUPT_GRACE_S = 2.0  # after Ctrl-C, how long the cancelled run may take to close its connections


def run_load_sync(config: LoadConfig, prompts: Sequence[str], progress: bool = True) -> LoadResult:
    """`run_load` from synchronous code, on an event loop of its own. Ctrl-C (in the main thread) cancels the
    run and raises KeyboardInterrupt; a run that has not wound down INTERRUPT_GRACE_S later is abandoned."""
    if threading.current_thread() is not threading.main_thread():  # no signal handlers off the main thread
        return asyncio.run(run_load(config, prompts, progress))
    return _run_interruptible(run_load(config, prompts, progress))


def _run_interruptible(coro):
    """Run `coro` to its result. On SIGINT: cancel it, give it INTERRUPT_GRACE_S to finish, then raise
    KeyboardInterrupt. asyncio.run would instead wait on the cancelled task for as long as it takes: a
    cancellation swallowed inside the HTTP client while a server never answers left `leanlm bench serve`
    running after Ctrl-C (seen once in CI: the loop idle in select() with the task pending)."""
    loop = asyncio.new_event_loop()
    main = loop.create_task(coro)
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        if interrupted:  # a second Ctrl-C: stop waiting at once
            loop.stop()
            return
        interrupted = True
        main.cancel()
        loop.call_later(INTERRUPT_GRACE_S, loop.stop)

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        return loop.run_until_complete(main)
    except (asyncio.CancelledError, RuntimeError):  # RuntimeError: stopped before the task completed
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if all(task.done() for task in asyncio.all_tasks(loop)):
            loop.run_until_complete(loop.shutdown_asyncgens())
        else:  # abandoned: tasks the interpreter drops at exit would otherwise each print an error
            loop.set_exception_handler(lambda loop, context: None)
        loop.close()
