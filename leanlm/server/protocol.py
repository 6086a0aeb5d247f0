"""The OpenAI wire format: request schemas (pydantic, strict types) and their mapping onto SamplingParams.

Unknown fields are ignored, as vLLM does, so clients that send newer parameters keep working; fields we do
not support but that change the result (suffix, functions, ...) are refused with a 400. `best_of` samples best_of
completions and returns the n with the highest mean token logprob. Structured output comes from OpenAI's
`response_format` (json_object, json_schema) or vLLM's `structured_outputs` body field (and its older `guided_*` names).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator

from leanlm.sampling_params import (
    MAX_LENGTH_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MIN_SEED,
    RequestOutputKind,
    SamplingParams,
)
from leanlm.server.schema import Strict as _Strict
from leanlm.server.tool_protocol import MAX_TOOLS, ChatTool, NamedToolChoice, ToolCallMessage
from leanlm.structured_outputs import StructuredOutputsParams

MAX_N = 128  # completions per prompt
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's chat API
# Per-request lists that the engine walks every step for every one of the n sequences: unbounded, one request
# slows the whole batch (a vocabulary-wide logit_bias with n=128 cost ~12 s per decode step). OpenAI caps
# logit_bias at 300 entries and stop at 4 strings; we keep vLLM's looser stop count.
MAX_LOGIT_BIAS = 300  # logit_bias entries
MAX_STOP = 16  # stop strings
MAX_EXPERTS = 1024  # experts a request may pin (more than any released MoE has per layer)
MAX_STOP_CHARS = 256  # characters per stop string (each is searched in a window this wide per token)
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids entries
# Prompts in one /v1/completions request and messages in one chat: each prompt is tokenized and each sequence
# must fit in the admission capacity (checked again against it in OpenAIServing), so a 16 MiB body of 2.8M
# one-token prompts is refused after the JSON parse instead of after 50 s of tokenizing.
MAX_PROMPTS = 1024
MAX_MESSAGES = 2048  # as OpenAI's chat API
# Characters of a structured output spec (a JSON schema as compact JSON, a regex, a grammar, the choices together):
# compiling one costs the prepare thread time and memory that grow with it; real schemas and tool grammars are a few KB.
MAX_STRUCTURED_OUTPUT_CHARS = 64 << 10
MAX_CHOICES = 1024  # strings of a `choice` spec

StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]


class LimitExceededError(ValueError):
    """A request larger than this server can ever admit (400, not 429: retrying cannot help); `param` names the
    field to shrink."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class InvalidParameterError(ValueError):
    """A request whose fields contradict each other (400); `param` names the field to change."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedParameterError(ValueError):
    """A known OpenAI parameter this server does not implement; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema."""

    name: str = Field(max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: stored as schema_, read and written as "schema"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # we always follow the schema strictly


class ResponseFormat(_Strict):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of the formats (StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    jump_forward: bool = True  # our extension: off only to measure what jump-forward decoding saves


class _SamplingFields(_Strict):
    """Fields shared by both endpoints: the OpenAI ones, then our (vLLM-named) extensions."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # The count limit belongs to the list form: on the union it would cap a single stop string's characters.
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, LogitBias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions.
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # static task routing on a mixture-of-experts model: only these experts serve the request (SamplingParams.experts)
    experts: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_EXPERTS)] | None = None
    # structured output: OpenAI's response_format, or vLLM's structured_outputs, or its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams, generating at most `max_tokens` (the request's, or the server's default
        when it names none). min_tokens above it is refused, as vLLM does, rather than quietly lowered."""
        if self.min_tokens > max_tokens:
            requested = self.requested_max_tokens()
            limit = "max_tokens" if requested == max_tokens else "the tokens this request may generate"
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= {limit} ({max_tokens}); lower min_tokens"
                + (" or raise max_tokens" if requested == max_tokens else " or send a max_tokens >= min_tokens"),
            )
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            logit_bias = {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise UnsupportedParameterError(
                "logit_bias", "logit_bias keys must be token ids (integers as strings)"
            ) from None
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=logit_bias,
            experts=None if self.experts is None else tuple(self.experts),
            structured_outputs=self.structured_outputs_params(),
            # Increments: a stream sends them as they come, and a whole response is merged from them once, so a
            # long or slowly read request costs O(its text), not a copy of everything so far per step.
            output_kind=RequestOutputKind.DELTA,
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one structured output spec the request names, or None. A 400 when it names several, when the spec is
        malformed or over MAX_STRUCTURED_OUTPUT_CHARS; whether it compiles is the engine's check (add_request)."""
        specs: dict[str, dict] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            specs["response_format"] = _response_format_spec(fmt)
        if self.structured_outputs is not None:
            body = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            specs["structured_outputs"] = {k: v for k, v in body.items() if not (k == "json_object" and not v)}
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                specs[name] = {name.removeprefix("guided_"): getattr(self, name)}
        if not specs:
            return None
        if len(specs) > 1:
            raise InvalidParameterError(
                list(specs)[1], f"give one structured output format; this request names {', '.join(specs)}"
            )
        ((param, fields),) = specs.items()
        try:
            params = StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as exc:
            raise InvalidParameterError(param, str(exc)) from None
        if params.num_spec_chars > MAX_STRUCTURED_OUTPUT_CHARS:
            raise LimitExceededError(
                param,
                f"the structured output spec has {params.num_spec_chars} characters; at most "
                f"{MAX_STRUCTURED_OUTPUT_CHARS} are allowed",
            )
        return params


def _response_format_spec(fmt: ResponseFormat) -> dict:
    """OpenAI's response_format as StructuredOutputsParams fields."""
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidParameterError(
                "response_format", "response_format json_schema needs json_schema: {name, schema: {...}}"
            )
        return {"json": fmt.json_schema.schema_}
    raise UnsupportedParameterError(
        "response_format", f"response_format {fmt.type!r} is not supported; use 'text', 'json_object' or 'json_schema'"
    )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    # A string, token ids, or a list of either. Typed as any list and checked in _check_prompt: a strict union of
    # list types records an error per item per failed branch (~10 s for a 16 MiB body of 2.8M prompts).
    prompt: str | list[Any]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    # Extensions (vLLM's names): beam search with best_of (else n) beams, the n best hypotheses returned.
    use_beam_search: bool = False
    # hypothesis score = cumulative logprob / length ** length_penalty
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    early_stopping: bool = False  # stop once beam-width hypotheses ended

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list) -> str | list:
        """One pass over the items, counts checked before shapes. (`type(x) is int`: JSON true is no token id.)"""
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("prompt is an empty list; give a string or token ids")
        if all(type(t) is int for t in prompt):
            return prompt  # one prompt of token ids (its length is checked against the context later)
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompt)}")
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
            return prompt
        raise ValueError("prompt must be a string, a list of token ids, or a list of strings or of token-id lists")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if type(prompt[0]) is int:
            return [list(prompt)]
        return list(prompt)

    def check_supported(self) -> None:
        if self.suffix:
            raise UnsupportedParameterError("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise UnsupportedParameterError(
                "best_of",
                f"best_of ({self.best_of}) must be >= n ({self.n}): it is how many completions are "
                f"sampled, n how many of them are returned",
            )
        if self.use_beam_search:
            self._check_beam_search()
        elif self.stream and self.num_samples > self.n:
            raise UnsupportedParameterError(
                "best_of",
                "best_of > n cannot be streamed (the best completions are known only at the end); "
                "send stream: false, or leave best_of unset",
            )

    def _check_beam_search(self) -> None:
        """Beam search keeps the most likely hypotheses: what only sampling or streaming means is refused."""
        if self.stream:
            raise UnsupportedParameterError(
                "stream", "beam search cannot be streamed (hypotheses change until the search ends); send stream: false"
            )
        refused = {
            "logprobs": self.logprobs is not None,
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "logit_bias": bool(self.logit_bias),
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "repetition_penalty": self.repetition_penalty != 1,
            "min_tokens": self.min_tokens != 0,
            "structured_outputs": self.structured_outputs_params() is not None,
        }
        for param, is_set in refused.items():
            if is_set:
                raise UnsupportedParameterError(
                    param, f"{param} is not supported with use_beam_search; leave it unset or sample instead"
                )

    @property
    def num_samples(self) -> int:
        """Completions sampled per prompt: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def as_dict(self) -> dict[str, Any]:
        """The turn as chat templates take it; the system-like "developer" role of newer clients is what chat
        templates call "system"."""
        turn: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        return turn

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True  # may one reply make several calls
    # The deprecated spelling of tools / tool_choice: refused (ignoring them would answer a request for a function
    # call with plain text).
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    add_generation_prompt: bool = True  # extension, as vLLM

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        for name, modern in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, name) not in (None, [], "none", "auto"):
                raise UnsupportedParameterError(name, f"the deprecated {name} is not supported; send {modern} instead")
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedParameterError("top_logprobs", "top_logprobs needs logprobs: true")
