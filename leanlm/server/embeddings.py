"""/v1/embeddings: each input becomes an embedding request (PoolingParams) in the same engine that generates, so
embeddings batch with generation; the answer is OpenAI's list of embeddings, as floats or base64 float32."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from leanlm.engine import RequestStream
from leanlm.lora_request import LoRARequest
from leanlm.pooling_params import PoolingParams
from leanlm.server.protocol import MAX_PROMPTS, InvalidParameterError, LimitExceededError
from leanlm.server.schema import Strict
from leanlm.server.serving import ContextLengthError, OpenAIServing
from leanlm.server.streaming import raise_if_failed


class EmbeddingRequest(Strict):
    """POST /v1/embeddings (OpenAI's shape; `pooling` and `normalize` are extensions, as vLLM's)."""

    model: str
    # one text, texts, one prompt as token ids, or prompts as token ids (OpenAI accepts all four)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"  # extension: the last token's hidden state, or the mean of all
    normalize: bool = True  # extension: unit L2 norm (OpenAI's embeddings are normalized)
    stream: Literal[False] = False  # embeddings come whole

    def inputs(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids; refuses an empty input (nothing to embed)."""
        value = self.input
        if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
            items = [value]
        else:
            items = list(value)
        if not items or any(len(item) == 0 for item in items):
            raise InvalidParameterError("input", "input must be a non-empty text or token list (or a list of them)")
        if len(items) > MAX_PROMPTS:
            raise LimitExceededError("input", f"input has {len(items)} items; send at most {MAX_PROMPTS} per request")
        return items


@dataclass
class EmbeddingJob:
    """One /v1/embeddings request in flight: a stream per input, in input order."""

    request_id: str  # "embd-..."
    model: str
    streams: list[RequestStream]
    encoding_format: str  # "float" or "base64"
    created: int = field(default_factory=lambda: int(time.time()))

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                stream.abort()


class EmbeddingServing:
    """Turns validated EmbeddingRequests into engine requests and their outputs into OpenAI's response."""

    def __init__(self, serving: OpenAIServing, hidden_size: int) -> None:
        self.serving = serving
        self.hidden_size = hidden_size  # the embedding's width

    async def start(self, request: EmbeddingRequest, client: str | None = None) -> EmbeddingJob:
        prompts, params, lora = await self.serving.off_loop(self._prepare, request)
        request_id = f"embd-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for idx, (text, ids) in enumerate(prompts):
                sub_id = f"{request_id}-{idx}"
                add = self.serving.engine.add_request
                streams.append(add(ids, params, sub_id, prompt_text=text, client=client, lora_request=lora))
        except BaseException:
            for stream in streams:  # every input is queued, or none is
                stream.abort()
            raise
        return EmbeddingJob(request_id, request.model, streams, request.encoding_format)

    def _prepare(
        self, request: EmbeddingRequest
    ) -> tuple[list[tuple[str | None, list[int]]], PoolingParams, LoRARequest | None]:
        """In a prepare thread: check, tokenize, and build the pooling parameters; the adapter `model` names."""
        serving = self.serving
        lora = serving.check_model(request.model)
        if request.dimensions is not None and request.dimensions != self.hidden_size:
            raise InvalidParameterError(
                "dimensions",
                f"this model's embeddings have {self.hidden_size} dimensions and it was not trained for shorter "
                f"(Matryoshka) ones; omit dimensions or pass {self.hidden_size}",
            )
        inputs = request.inputs()
        serving.check_admissible(len(inputs), 1)
        for item in inputs:
            if isinstance(item, str):
                serving.check_prompt_chars(len(item), "input")
        prompts = [serving.llm_engine.tokenize_prompt(item) for item in inputs]
        for _, ids in prompts:
            if len(ids) >= serving.max_model_len:
                raise ContextLengthError(
                    f"an input has {len(ids)} tokens; this model embeds at most {serving.max_model_len - 1}; "
                    f"shorten it",
                    "input",
                )
        return prompts, PoolingParams(pooling=request.pooling, normalize=request.normalize), lora

    async def response(self, job: EmbeddingJob) -> dict:
        finals = await asyncio.gather(*(stream.result() for stream in job.streams))
        data = []
        for idx, final in enumerate(finals):
            for completion in final.outputs:
                raise_if_failed(completion)
            data.append({"object": "embedding", "index": idx, "embedding": _encode(final.embedding, job)})
        num_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return {
            "object": "list",
            "data": data,
            "model": job.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }


def _encode(embedding, job: EmbeddingJob) -> list[float] | str:
    """floats, or base64 of the little-endian float32 bytes (what the openai client asks for by default)."""
    if job.encoding_format == "base64":
        return base64.b64encode(embedding.numpy().astype("<f4").tobytes()).decode("ascii")
    return embedding.tolist()
