"""Proposer: what SpecDecoder asks of a way to draft tokens, and the one chosen from a SpeculativeConfig.

Three kinds implement it: prompt lookup (n-grams of the request's own text; `suffix` follows the copy across
edits), lookahead (Jacobi iteration and an n-gram pool) and a draft model (a smaller model, or the target's
first layers: DraftProposer). SpecDecoder holds exactly one and never asks which kind it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from leanlm.config import SpeculativeConfig
from leanlm.engine.lookahead_proposer import LookaheadProposer
from leanlm.engine.ngram_proposer import NgramProposer
from leanlm.engine.request import Request
from leanlm.engine.suffix_proposer import SuffixProposer


@dataclass
class DraftJob:
    """One request's proposal: continue its tokens (`token_ids`, the newest at `position`, no KV yet) for
    `num_tokens` tokens."""

    request: Request
    token_ids: list[int]  # prompt and output so far, the step's new tokens included
    num_tokens: int
    block_ids: list[int]  # covering position + num_tokens - 1

    @property
    def position(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class Drafts:
    token_ids: list[list[int]]  # per job
    probs: list[torch.Tensor | None]  # per job: [num_tokens, V] the draft distribution behind each random
    # request's tokens; None for certain drafts (text lookups) and greedy requests (the draft's argmax)
    step_seconds: float | None = None  # mean time of the batched draft steps after the first (which also catches
    # up on unseen tokens); None when there was only one, or the proposer runs no model


class Proposer(Protocol):
    # Drafts write KV at the positions they take (a model drafts autoregressively): they stop where the
    # request's blocks end, and the scheduler reserves lookahead slots for them.
    writes_kv: bool
    relative_cost: float  # one draft token's cost relative to a target step, until measured

    def propose(self, jobs: list[DraftJob]) -> Drafts: ...

    def observe(self, request_id: str, inputs: Sequence[int], predictions: Sequence[int], num_accepted: int) -> None:
        """A verification's outcome: the verified inputs (last real token, then drafts), the target's argmax at
        each row, and how many drafts it accepted."""

    def forget(self, request_ids: Sequence[str]) -> None: ...

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of the target's blocks, for proposers with a cache of their own."""


class PromptLookup:
    """Prompt lookup (Saxena 2023): the continuation of the latest earlier match of the context's tail."""

    writes_kv = False
    relative_cost = 0.05

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, jobs: list[DraftJob]) -> Drafts:
        return Drafts([self.ngram.propose(job.token_ids, job.num_tokens) for job in jobs], [None] * len(jobs))

    def observe(self, request_id, inputs, predictions, num_accepted) -> None:
        pass

    def forget(self, request_ids) -> None:
        pass

    def copy_blocks(self, src, dst) -> None:
        pass


class Lookahead(PromptLookup):
    """Jacobi iteration of the target itself plus an n-gram pool (LookaheadProposer)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookahead = LookaheadProposer(config.prompt_lookup_max)

    def propose(self, jobs: list[DraftJob]) -> Drafts:
        tokens = [self.lookahead.propose(job.request.request_id, job.token_ids, job.num_tokens) for job in jobs]
        return Drafts(tokens, [None] * len(jobs))

    def observe(self, request_id, inputs, predictions, num_accepted) -> None:
        self.lookahead.observe(request_id, inputs, predictions, num_accepted)

    def forget(self, request_ids) -> None:
        self.lookahead.forget(request_ids)


class SuffixLookup(PromptLookup):
    """Prompt lookup that follows the copied source across edits (SuffixProposer)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.suffix = SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, jobs: list[DraftJob]) -> Drafts:
        tokens = [self.suffix.propose(job.request.request_id, job.token_ids, job.num_tokens) for job in jobs]
        return Drafts(tokens, [None] * len(jobs))

    def forget(self, request_ids) -> None:
        self.suffix.forget(request_ids)


# The proposers that need no model, by SpeculativeConfig.method; "draft" and "self" are DraftProposers, which the
# model runner builds (they need the target's model and KV cache).
TEXT_PROPOSERS: dict[str, type[PromptLookup]] = {"ngram": PromptLookup, "suffix": SuffixLookup, "lookahead": Lookahead}


def build_proposer(config: SpeculativeConfig, model_proposer: Proposer | None = None) -> Proposer:
    """The proposer `config` names: a text proposer, or the model proposer built for it."""
    if config.uses_model:
        if model_proposer is None:
            raise ValueError(f"speculative method {config.method!r} needs a draft model")
        return model_proposer
    return TEXT_PROPOSERS[config.method](config)
