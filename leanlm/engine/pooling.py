"""Embedding requests' pooling between steps: each step's pooled rows (StepOutput.pooled) accumulate on the request;
when its prompt is done, the embedding is the mean or last row, L2-normalized if asked."""

from __future__ import annotations

import torch

from leanlm.engine.request import Request


def add_chunk(request: Request, num_computed: int, pooled: torch.Tensor | None) -> bool:
    """An embedding request computed `num_computed` more prompt tokens, which pooled to `pooled` [hidden] (None: its
    chunk pools nothing, last-token pooling before the last chunk). True when its prompt is done: it has its
    embedding and finishes."""
    start = request.num_computed_tokens
    request.num_computed_tokens += num_computed
    if pooled is not None:
        add_pooled(request, pooled, start)
    if not request.is_prefill_done:
        return False
    finish_embedding(request)
    return True


def add_pooled(request: Request, pooled: torch.Tensor, chunk_start: int) -> None:
    """Take one chunk's pooled row [hidden] float32 (its rows' sum, or the prompt's last row). A chunk that starts at
    position 0 starts over: a preempted request recomputes its prompt from the beginning (mean pooling never takes
    prefix-cache hits, so no chunk starts past rows that were not pooled)."""
    if chunk_start == 0 or request.pooled_sum is None:
        request.pooled_sum = pooled.clone()
    else:
        request.pooled_sum += pooled


def finish_embedding(request: Request) -> None:
    """Set request.embedding [hidden] float32 from the pooled rows of its whole prompt."""
    params = request.pooling_params
    embedding = request.pooled_sum
    if embedding is None:  # cannot happen: the prompt's last chunk always pools
        raise RuntimeError(f"embedding request {request.request_id!r} finished its prompt without pooled rows")
    if params.pooling == "mean":
        embedding = embedding / request.num_prompt_tokens
    if params.normalize:
        embedding = torch.nn.functional.normalize(embedding, dim=0)
    request.embedding = embedding
    request.pooled_sum = None
