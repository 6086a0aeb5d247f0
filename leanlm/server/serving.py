"""OpenAIServing: turns validated /v1/completions and /v1/chat/completions requests into engine requests, and
their outputs into whole responses or server-sent-event streams. Knows nothing of HTTP.

Parsing, tokenizing and rendering chat templates take time proportional to what a client sends; they run in a
small thread pool, so the event loop keeps streaming to everyone else meanwhile (the `tokenizers` encode releases
the GIL). A text prompt longer than `max_prompt_chars` is refused before it is tokenized, the queue of work for
that pool is bounded, and work still queued is dropped when its client hangs up. Only queueing the prepared
request (`_start`) touches the event loop's state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from leanlm import selection
from leanlm.engine import (
    AsyncLLMEngine,
    BeamSearchParams,
    QueueFullError,
    RequestStream,
)
from leanlm.loading.chat_encoding import check_mode as check_control_token_mode
from leanlm.loading.chat_encoding import encode_chat
from leanlm.loading.chat_template import ChatTemplateTooLongError
from leanlm.lora_request import LoRARequest
from leanlm.sampling_params import SamplingParams
from leanlm.server import responses, streaming
from leanlm.server.chat_tools import prepare_tools
from leanlm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameterError,
    LimitExceededError,
)
from leanlm.server.served_models import ServedModels
from leanlm.server.streaming import raise_if_failed
from leanlm.structured_outputs import StructuredOutputsParams
from leanlm.tool_calls import PARSERS, ToolCallParser

_T = TypeVar("_T")

# Threads that parse and tokenize requests: two, so one huge request does not hold up every other, and few, so
# a flood of them cannot take more CPU from the engine thread than two threads can.
NUM_PREPARE_THREADS = 2


class ContextLengthError(ValueError):
    """Prompt plus requested tokens exceed the context; `param` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Job:
    """One HTTP request in flight: its prompts' streams, and how to render them."""

    request_id: str  # "cmpl-..." / "chatcmpl-..."
    is_chat: bool
    model: str
    streams: list[RequestStream]  # one per prompt, in prompt order
    prompt_texts: list[str]  # for echo
    n: int  # completions returned per prompt
    num_top_logprobs: int | None  # None: no logprobs
    echo: bool
    include_usage: bool
    # best_of > n: completions sampled per prompt, of which the n best are returned (usage counts them all, as
    # OpenAI bills them); None when every sampled completion is returned
    best_of: int | None = None
    is_beam_search: bool = False  # completions are beam hypotheses, best first
    tool_parser: ToolCallParser | None = None  # a chat whose replies are read for tool calls: their family
    created: int = field(default_factory=lambda: int(time.time()))

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                stream.abort()


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_names: list[str],
        default_max_tokens: int | None = None,
        max_prompt_chars: int | None = None,
        max_pending_prepares: int = 64,
        chat_control_tokens: str = "text",
        tool_call_parser: str | None = None,
    ) -> None:
        check_control_token_mode(chat_control_tokens)
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
        # The family whose tool calls replies are read for; None: the one the chat template teaches.
        self.tool_call_parser = tool_call_parser
        # What control-token text in a chat message becomes: text (default), a 400 (reject), or ids (parse).
        self.chat_control_tokens = chat_control_tokens
        if default_max_tokens is not None and default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens must be >= 1 or None (the rest of the context), got {default_max_tokens}"
            )
        if max_prompt_chars is not None and max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or None (derived), got {max_prompt_chars}")
        if max_pending_prepares < 1:
            raise ValueError(f"max_pending_prepares must be >= 1, got {max_pending_prepares}")
        self.engine = engine
        # Tokens generated when a request names no max_tokens (chat; completions default to 16 as OpenAI's):
        # the whole remaining context would let every client hold its KV blocks for the longest possible time.
        self.default_max_tokens = default_max_tokens
        self.model_names = model_names
        self.served = ServedModels(model_names, engine.engine)  # the base model's names and the LoRA adapters'
        self.llm_engine = engine.engine
        self.tokenizer = self.llm_engine.tokenizer
        self.max_model_len = self.llm_engine.max_model_len
        self.texts = responses.TokenTexts(self.tokenizer)
        # A text longer than the context times the longest token has more tokens than the context holds: refused
        # before tokenizing (which takes time and, for megabytes, gigabytes of memory).
        self.max_prompt_chars = max_prompt_chars or self.max_model_len * self.tokenizer.max_token_chars
        self.max_pending_prepares = max_pending_prepares  # calls queued or running in the prepare threads
        self._num_pending = 0
        self._pending_lock = threading.Lock()  # the count drops in whichever thread finishes or cancels the work
        self._executor = ThreadPoolExecutor(NUM_PREPARE_THREADS, thread_name_prefix="leanlm-prepare")

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run fn(*args) in the prepare threads (for work whose cost the client chooses). At most
        max_pending_prepares calls wait or run at once (beyond: QueueFullError, a 429); cancelling the awaiting task
        (its client hung up) drops the call if it has not started."""
        with self._pending_lock:
            if self._num_pending >= self.max_pending_prepares:
                raise QueueFullError(
                    f"the server is busy preparing {self._num_pending} requests (limit {self.max_pending_prepares}); "
                    f"retry later",
                    retry_after_s=1,
                )
            self._num_pending += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(self._prepare_done)
        return await asyncio.wrap_future(future)  # cancelling this cancels a call still queued

    def _prepare_done(self, future: Future) -> None:
        with self._pending_lock:
            self._num_pending -= 1

    @property
    def num_pending_prepares(self) -> int:
        return self._num_pending

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise ContextLengthError(
                f"the prompt has {num_chars} characters, more than the {self.max_prompt_chars} this server tokenizes "
                f"(this model's maximum context length is {self.max_model_len} tokens); shorten the prompt",
                param,
            )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, name: str) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model; ModelNotFoundError (404) otherwise."""
        return self.served.resolve(name)

    # -- starting requests ----------------------------------------------------------------------------

    async def start_completion(self, request: CompletionRequest, client: str | None = None) -> Job:
        """`client` (an address or key) is what the engine's per-client limit counts."""
        return self._start(**await self.off_loop(self._prepare_completion, request), client=client)

    async def start_chat(self, request: ChatCompletionRequest, client: str | None = None) -> Job:
        return self._start(**await self.off_loop(self._prepare_chat, request), client=client)

    def check_admissible(self, num_prompts: int, num_samples: int) -> None:
        """Refuse, before tokenizing anything, a request with more sequences than the engine would ever admit."""
        limit = self.engine.max_seqs_per_request
        if num_prompts * num_samples > limit:
            raise LimitExceededError(
                "prompt" if num_prompts > 1 else "n",
                f"this request asks for {num_prompts} prompt(s) x {num_samples} completion(s) = "
                f"{num_prompts * num_samples} sequences, but the server admits at most {limit} from one client; "
                f"split it into smaller requests",
            )

    def _prepare_completion(self, request: CompletionRequest) -> dict:
        """In a prepare thread: validate, tokenize and build the parameters; the keyword arguments of _start."""
        lora = self.check_model(request.model)
        request.check_supported()
        self.check_admissible(len(request.prompts()), request.num_samples)
        for prompt in request.prompts():
            if isinstance(prompt, str):
                self.check_prompt_chars(len(prompt), "prompt")
        prompts = [self.llm_engine.tokenize_prompt(p) for p in request.prompts()]
        if request.use_beam_search:
            if lora is not None:
                raise ValueError("beam search does not run LoRA adapters; sample, or ask the base model")
            return self._prepare_beam_search(request, prompts)
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        num_samples = request.num_samples
        # best_of ranks by mean token logprob: sample with logprobs even when the client asked for none.
        logprobs = 0 if num_samples > request.n and request.logprobs is None else request.logprobs
        # One SamplingParams per distinct max_tokens, shared by every prompt (and, in the engine, every child).
        by_max_tokens: dict[int, SamplingParams] = {}
        jobs_params = []
        for _, ids in prompts:
            max_tokens = self._max_tokens(len(ids), request.max_tokens, "max_tokens")
            if max_tokens not in by_max_tokens:
                by_max_tokens[max_tokens] = dataclasses.replace(
                    request.sampling_params(max_tokens, logprobs, prompt_logprobs), n=num_samples
                )
            jobs_params.append(by_max_tokens[max_tokens])
        texts = [text if text is not None else self.tokenizer.decode(ids) for text, ids in prompts]
        return dict(
            prefix="cmpl",
            is_chat=False,
            model=request.model,
            prompts=prompts,
            params=jobs_params,
            prompt_texts=texts,
            n=request.n,
            num_top_logprobs=request.logprobs,
            echo=request.echo,
            include_usage=request.include_usage_in_stream,
            best_of=num_samples if num_samples > request.n else None,
            lora_request=lora,
        )

    def _prepare_beam_search(self, request: CompletionRequest, prompts: list[tuple[str | None, list[int]]]) -> dict:
        """best_of (else n) beams per prompt; the async engine runs each search between its steps."""
        params = [
            BeamSearchParams(
                beam_width=request.num_samples,
                max_tokens=self._max_tokens(len(ids), request.max_tokens, "max_tokens"),
                length_penalty=request.length_penalty,
                early_stopping=request.early_stopping,
                ignore_eos=request.ignore_eos,
                skip_special_tokens=request.skip_special_tokens,
            )
            for _, ids in prompts
        ]
        texts = [text if text is not None else self.tokenizer.decode(ids) for text, ids in prompts]
        return dict(
            prefix="cmpl",
            is_chat=False,
            model=request.model,
            prompts=prompts,
            params=params,
            prompt_texts=texts,
            n=request.n,
            num_top_logprobs=None,
            echo=request.echo,
            include_usage=False,
            is_beam_search=True,
        )

    def _prepare_chat(self, request: ChatCompletionRequest) -> dict:
        """In a prepare thread: render the chat template, tokenize, build the parameters."""
        lora = self.check_model(request.model)
        request.check_supported()
        self.check_admissible(1, request.n)
        tools = prepare_tools(request, self.tokenizer.chat_template, self.tool_call_parser)
        messages = tools.messages
        self.check_prompt_chars(sum(len(m["content"] or "") for m in messages), "messages")
        try:
            text, ids = encode_chat(
                self.tokenizer,
                messages,
                request.add_generation_prompt,
                self.chat_control_tokens,
                max_chars=self.max_prompt_chars,
                tools=tools.template_tools,
            )
        except ChatTemplateTooLongError as e:
            raise ContextLengthError(
                f"{e}, more than this model's context of {self.max_model_len} tokens can hold; shorten the messages",
                "messages",
            ) from e
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = self._max_tokens(len(ids), request.requested_max_tokens(), "max_completion_tokens")
        params = request.sampling_params(max_tokens, num_top, None)
        if tools.grammar is not None:  # the reply must be calls, each held to its function's schema
            if params.structured_outputs is not None:
                raise InvalidParameterError(
                    "tool_choice", "a required tool call constrains the reply already; drop response_format"
                )
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=tools.grammar))
        return dict(
            prefix="chatcmpl",
            tool_parser=tools.parser,
            is_chat=True,
            model=request.model,
            prompts=[(text, ids)],
            params=[params],
            prompt_texts=[text],
            n=request.n,
            num_top_logprobs=num_top,
            echo=False,
            include_usage=request.include_usage_in_stream,
            lora_request=lora,
        )

    def _max_tokens(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens; shorten the prompt",
                "messages" if param != "max_tokens" else "prompt",
            )
        if requested is None:
            return min(room, self.default_max_tokens or room)
        if requested > room:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens, but you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
                f"completion); reduce the prompt or {param}",
                param,
            )
        return requested

    def _start(
        self,
        prefix: str,
        prompts: list,
        params: list,
        client: str | None = None,
        lora_request: LoRARequest | None = None,
        **fields: Any,
    ) -> Job:
        """Queue every prompt (all or none: a failure aborts those queued), on `lora_request`'s adapter (None: the
        base); `fields` are the Job's own."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        add = self.engine.add_beam_search if fields.get("is_beam_search") else self.engine.add_request
        if lora_request is not None:
            add = functools.partial(add, lora_request=lora_request)
        streams: list[RequestStream] = []
        try:
            for idx, ((text, ids), p) in enumerate(zip(prompts, params)):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{idx}"
                streams.append(add(ids, p, request_id=sub_id, prompt_text=text, client=client))
        except BaseException:
            for stream in streams:  # all prompts of a request are queued, or none is
                stream.abort()
            raise
        return Job(request_id, streams=streams, **fields)

    # -- whole responses ------------------------------------------------------------------------------

    async def full_response(self, job: Job) -> dict:
        finals = await asyncio.gather(*(stream.result() for stream in job.streams))
        choices = []
        for prompt_idx, final in enumerate(finals):
            for completion in final.outputs:
                raise_if_failed(completion)
            completions = final.outputs  # beam hypotheses come best first: the n best are the first n
            if job.best_of is not None:  # the n with the highest mean token logprob, best first
                completions = selection.best_of(completions).top(job.n)
            completions = completions[: job.n]
            for choice_idx, completion in enumerate(completions):
                index = prompt_idx * job.n + choice_idx
                choices.append(responses.choice(job, self.texts, prompt_idx, final, completion, index))
        body = responses.envelope(
            job.request_id, "chat.completion" if job.is_chat else "text_completion", job.model, job.created
        )
        body["choices"] = choices
        body["usage"] = responses.usage(finals)
        return body

    # -- streams --------------------------------------------------------------------------------------

    def sse_stream(self, job: Job) -> AsyncIterator[str]:
        """Server-sent events of a job (server/streaming.py)."""
        return streaming.sse_events(job, self.texts)
