"""Engine outputs -> OpenAI response bodies: choices, streamed deltas, logprobs in the completions and chat
shapes, and usage. Pure functions over RequestOutput plus a token-text cache."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from leanlm.engine import CompletionOutput, RequestOutput
from leanlm.loading.tokenizer import Tokenizer
from leanlm.server.chat_tools import assistant_message
from leanlm.tool_calls import ToolCallStreamer

if TYPE_CHECKING:
    from leanlm.server.serving import Job


class TokenTexts:
    """Text of single tokens, as logprobs show them (special tokens included; a piece of a multi-byte
    character shows as U+FFFD, the way the tokenizer decodes it alone)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _top(logprobs: dict[int, float], num: int) -> list[tuple[int, float]]:
    """The `num` most likely entries, most likely first."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:num]


def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    logprobs: list[dict[int, float] | None],
    num_top: int,
    text_offset: int = 0,
) -> dict:
    """The /v1/completions `logprobs` object for a run of tokens. A None entry (the first prompt token,
    which nothing predicts) gives null logprobs, as OpenAI's echo does."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = texts.text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(lp.get(token_id))
        top = {texts.text(t): v for t, v in _top(lp, num_top)}
        top.setdefault(text, lp.get(token_id))  # the chosen token is always listed, as vLLM does
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> dict:
    """The /v1/chat/completions `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token_id: int, value: float) -> dict:
        text = texts.text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, lp in zip(token_ids, logprobs):
        item = entry(token_id, lp[token_id])
        item["top_logprobs"] = [entry(t, v) for t, v in _top(lp, num_top)]
        content.append(item)
    return {"content": content}


def usage(outputs: list[RequestOutput], completion_tokens: int | None = None) -> dict:
    """Prompt tokens counted once per prompt (not per completion), completion tokens over all choices (those of
    the outputs, which must then be whole results, unless the caller counted them)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs if o.metrics is not None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(completion: CompletionOutput) -> str | None:
    """OpenAI's finish reasons are 'stop' and 'length'; an aborted or failed completion has no answer."""
    return completion.finish_reason if completion.finish_reason in ("stop", "length") else None


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has already sent."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False
    tools: ToolCallStreamer | None = None  # a chat read for tool calls: what of its text is calls


def envelope(request_id: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model}


def choice(job: Job, texts: TokenTexts, prompt_idx: int, final: RequestOutput, c: CompletionOutput, index: int) -> dict:
    """One choice of a whole response: a chat message (its tool calls read out when the job reads them) or a text."""
    if job.is_chat:
        message, calls_tools = assistant_message(c.text, job.tool_parser)
        reason = finish_reason(c)
        out = {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": "tool_calls" if calls_tools and reason == "stop" else reason,
            "stop_reason": c.stop_reason,
        }
        if job.num_top_logprobs is not None:
            out["logprobs"] = chat_logprobs(texts, c.token_ids, c.logprobs, job.num_top_logprobs)
        return out
    prefix = job.prompt_texts[prompt_idx] if job.echo else ""
    out = {
        "index": index,
        "text": prefix + c.text,
        "logprobs": None,
        "finish_reason": finish_reason(c),
        "stop_reason": c.stop_reason,
    }
    if job.num_top_logprobs is not None:
        ids, lps = list(c.token_ids), list(c.logprobs)
        if job.echo:
            ids = final.prompt_token_ids + ids
            lps = list(final.prompt_logprobs) + lps
        out["logprobs"] = completion_logprobs(texts, ids, lps, job.num_top_logprobs)
    return out
