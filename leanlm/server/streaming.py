"""Server-sent events for a job: a chunk per new piece of each choice (OpenAI's completions and chat chunk
shapes), the usage chunk if asked, then [DONE]; several prompts' streams merged in arrival order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from leanlm.engine import CompletionOutput, EngineStoppedError, RequestFailedError, RequestOutput, RequestStream
from leanlm.sampling_params import RequestOutputKind
from leanlm.server import responses
from leanlm.server.protocol import UnsupportedParameterError
from leanlm.tool_calls import ToolCall, ToolCallStreamer

if TYPE_CHECKING:
    from leanlm.server.serving import Job


async def sse_events(job: Job, texts: responses.TokenTexts) -> AsyncIterator[str]:
    """Server-sent events: a chunk per new piece of each choice, the usage chunk if asked, then [DONE].
    A failure after the stream started is sent as an `error` event (the HTTP status is already 200)."""
    cursors: dict[int, responses.ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    obj = "chat.completion.chunk" if job.is_chat else "text_completion"
    encode = ChunkEncoder(responses.envelope(job.request_id, obj, job.model, job.created), job.include_usage)
    try:
        async for prompt_idx, output in _merged(job.streams):
            choices = _delta_choices(job, texts, prompt_idx, output, cursors)
            if output.finished:
                finals[prompt_idx] = output
            if choices:
                yield encode(choices)
        if job.include_usage:
            chunk = responses.envelope(job.request_id, obj, job.model, job.created)
            chunk["choices"] = []
            # The outputs are deltas: the completion tokens are what the cursors counted.
            num_completion_tokens = sum(cursor.num_tokens for cursor in cursors.values())
            chunk["usage"] = responses.usage([finals[i] for i in sorted(finals)], num_completion_tokens)
            yield _sse(chunk)
    except (RequestFailedError, UnsupportedParameterError, EngineStoppedError) as exc:
        yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
    finally:
        job.abort()  # no-op unless the client went away mid-stream
    yield "data: [DONE]\n\n"


def _delta_choices(
    job: Job, texts: responses.TokenTexts, prompt_idx: int, output: RequestOutput, cursors: dict
) -> list[dict]:
    choices = []
    for c in output.outputs:
        raise_if_failed(c)
        index = prompt_idx * job.n + c.index
        cursor = cursors.get(index)
        if cursor is None:
            cursor = cursors[index] = responses.ChoiceCursor()
            if job.tool_parser is not None:
                cursor.tools = ToolCallStreamer(job.tool_parser)
            if job.is_chat:  # the first chunk of a chat choice carries the role
                choices.append(
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            elif job.echo:
                choices.append(_echo_chunk(job, texts, prompt_idx, output, index))
        if cursor.finished:
            continue
        if output.kind == RequestOutputKind.DELTA:  # what the server asks for: each output is its increment
            new_text, new_ids, new_logprobs = c.text, c.token_ids, c.logprobs or []
        else:
            new_text, new_ids = c.text[cursor.num_chars :], c.token_ids[cursor.num_tokens :]
            new_logprobs = c.logprobs[cursor.num_tokens :] if c.logprobs else []
        cursor.num_chars += len(new_text)
        cursor.num_tokens += len(new_ids)
        reason = responses.finish_reason(c)
        calls = []
        if cursor.tools is not None:  # text that may be a tool call is held back until it is known
            new_text, calls, reason = _tool_calls(cursor.tools, new_text, reason)
        if not new_text and not calls and reason is None and (job.num_top_logprobs is None or not new_ids):
            continue  # tokens whose text is still held back (a partial character or a stop prefix)
        choice = _delta(job, texts, index, new_text, new_ids, new_logprobs)
        if calls:
            first = cursor.tools.num_sent_calls - len(calls)
            choice["delta"]["tool_calls"] = [{"index": first + k, **call.to_openai()} for k, call in enumerate(calls)]
            choice["delta"]["content"] = new_text or None
        choice["finish_reason"] = reason
        if reason is not None:
            choice["stop_reason"] = c.stop_reason
        cursor.finished = c.finished
        choices.append(choice)
    return choices


def _tool_calls(streamer: ToolCallStreamer, text: str, reason: str | None) -> tuple[str, list[ToolCall], str | None]:
    """(the text to send, the calls to send, the finish reason: "tool_calls" for a reply that made calls)."""
    text, calls = streamer.feed(text)
    if reason is not None:
        tail, more = streamer.finish()
        text, calls = text + tail, calls + more
        if streamer.has_calls and reason == "stop":
            reason = "tool_calls"
    return text, calls, reason


def _delta(job: Job, texts: responses.TokenTexts, index: int, text: str, ids: list[int], lps: list) -> dict:
    if job.is_chat:
        choice = {"index": index, "delta": {"content": text}, "logprobs": None}
        if job.num_top_logprobs is not None:
            choice["logprobs"] = responses.chat_logprobs(texts, ids, lps, job.num_top_logprobs)
        return choice
    choice = {"index": index, "text": text, "logprobs": None}
    if job.num_top_logprobs is not None:
        choice["logprobs"] = responses.completion_logprobs(texts, ids, lps, job.num_top_logprobs)
    return choice


def _echo_chunk(job: Job, texts: responses.TokenTexts, prompt_idx: int, output: RequestOutput, index: int) -> dict:
    choice = {"index": index, "text": job.prompt_texts[prompt_idx], "logprobs": None, "finish_reason": None}
    if job.num_top_logprobs is not None and output.prompt_logprobs is not None:
        choice["logprobs"] = responses.completion_logprobs(
            texts, output.prompt_token_ids, output.prompt_logprobs, job.num_top_logprobs
        )
    return choice


def raise_if_failed(completion: CompletionOutput) -> None:
    if completion.finish_reason == "error":
        raise RequestFailedError(completion.error or "the request failed")


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams, in arrival order. The queue holds one item: a pump waits
    while the reader is slow, so outputs coalesce in its RequestStream instead of piling up here."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(idx: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((idx, output))
        except BaseException as exc:
            await queue.put((idx, exc))
        await queue.put((idx, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            idx, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield idx, item
    finally:
        for task in tasks:
            task.cancel()


class ChunkEncoder:
    """The event of each delta chunk of one stream, as `_sse` of envelope + {"choices", "usage": null if asked}
    would write it, character for character. The envelope (id, object, created, model) is the same in every chunk
    of a stream: it is encoded once, and each chunk encodes only its choices (a chunk per token per stream)."""

    def __init__(self, envelope: dict, include_usage: bool) -> None:
        head = json.dumps(envelope, ensure_ascii=False)
        if not envelope or not head.endswith("}"):
            raise ValueError(f"the envelope must be a non-empty JSON object, got {envelope!r}")
        self.head = f'data: {head[:-1]}, "choices": '  # `{..., "model": "..."` and the choices key
        self.tail = ', "usage": null}\n\n' if include_usage else "}\n\n"

    def __call__(self, choices: list[dict]) -> str:
        return self.head + json.dumps(choices, ensure_ascii=False) + self.tail


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
