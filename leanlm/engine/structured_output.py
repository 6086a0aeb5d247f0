"""StructuredOutput: the model runner's collaborator for constrained requests (each holds its llguidance LLMatcher in
Request.grammar). Per step it computes the sample rows' token masks in a background thread while the forward runs,
feeds each matcher the tokens sampled for it, appends the tokens the grammar forces (jump-forward decoding, as SGLang's
compressed finite-state machine: one forward for a forced run instead of one per token) and trims speculative drafts
to their grammar-valid prefix."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

from leanlm.engine.request import Request

# Threads llguidance's executor spreads one step's masks over; the forward, running at the same time, has the rest.
MAX_MASK_THREADS = 4
# Shortest forced run jump-forward appends. A run of k tokens saves k one-token decode steps and makes the next step
# compute k + 1 tokens of the request; those enter attention as decode entries (step_plan._decode_runs), so the step
# stays on the one-token decode path: SmolLM2-135M on AVX2 measured 10.3 ms for 1 token, 12.4 / 14.8 / 26.8 ms for
# 2 / 4 / 8 (docs/structured_output.md). Every forced run pays for itself.
MIN_JUMP_FORWARD_TOKENS = 1


@dataclass
class GrammarMask:
    """The tokens each constrained sample row may not take."""

    rows: torch.Tensor  # [M] long: indices of the constrained rows among the step's N sample rows
    banned: torch.Tensor  # [M, V] bool: True where the grammar forbids the token at that row


@dataclass
class GrammarAdvance:
    """What feeding one step's sampled tokens to the matchers produced, per sampling request."""

    num_forced: list[int]  # tokens jump-forward appended to the request's sampled tokens
    errors: list[str | None]  # why the request's matcher failed (the request then fails alone), or None


class StructuredOutput:
    """Stateless between steps but for its threads: the matchers live on the requests, so a finished or aborted request
    takes its own along. One mask job runs at a time (a single worker), so a job abandoned by a batch that raised ends
    before the next one touches the same matchers."""

    def __init__(self, vocab_size: int, max_model_len: int | None) -> None:
        self.vocab_size = vocab_size  # mask width: the model's logit rows
        self.max_model_len = max_model_len
        self._pool: ThreadPoolExecutor | None = None  # built with the first constrained step
        self._executor: llguidance.LLExecutor | None = None
        self.num_forced_tokens = 0  # tokens appended by jump-forward since the engine started
        self.min_jump_forward_tokens = MIN_JUMP_FORWARD_TOKENS

    def start_masks(self, requests: list[Request], drafts: list[list[int]]) -> Future[GrammarMask] | None:
        """Begin computing the masks of a step's sample rows (request i owns len(drafts[i]) + 1 consecutive rows: its
        next token, then one after each draft). None when no request is constrained: the step pays nothing."""
        jobs: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        row = 0
        for request, draft in zip(requests, drafts):
            if request.grammar is not None:
                jobs.append((request.grammar, row, list(draft)))
            row += len(draft) + 1
        if not jobs:
            return None
        if self._pool is None:
            threads = max(1, min(MAX_MASK_THREADS, (os.cpu_count() or 2) // 2))
            self._executor = llguidance.LLExecutor(threads)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="leanlm-grammar")
        return self._pool.submit(self._compute_masks, jobs)

    def _compute_masks(self, jobs: list[tuple[llguidance.LLMatcher, int, list[int]]]) -> GrammarMask:
        """In the worker thread (llguidance drops the GIL): the constrained rows' bitmasks, unpacked to [M, V] bool."""
        rows = [first + i for _, first, draft in jobs for i in range(len(draft) + 1)]
        local = {r: i for i, r in enumerate(rows)}  # sample row -> row of the bitmask
        # -1: every bit set. A row after a draft the grammar rejects keeps it; such a row is never reached (the masked
        # target gives the invalid draft probability 0, so verification rejects it first).
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        if any(draft for _, _, draft in jobs):
            fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(m, local[first], draft) for m, first, draft in jobs], bitmask
            )
        else:
            fill_next_token_bitmask_par(self._executor, [(m, local[first]) for m, first, _ in jobs], bitmask)
        # Bit j of 32-bit word w allows token 32 w + j: the words' bytes, little-endian, unpacked low bit first.
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return GrammarMask(torch.tensor(rows, dtype=torch.long), torch.from_numpy(bits == 0))

    def advance(self, requests: list[Request], token_ids: list[list[int]], had_drafts: list[bool]) -> GrammarAdvance:
        """Feed each constrained request the tokens sampled for it this step (not yet appended to it). With
        jump-forward, then extend `token_ids[i]` in place by the tokens the grammar forces next: they become output
        tokens whose KV the next step computes as one chunk. Not in a step that verified drafts (the scheduler reads
        len(token_ids) - 1 as the accepted drafts), and never past max_tokens or the context."""
        num_forced = [0] * len(requests)
        errors: list[str | None] = [None] * len(requests)
        for i, (request, tokens) in enumerate(zip(requests, token_ids)):
            matcher = request.grammar
            if matcher is None or not tokens:
                continue
            # one by one: llguidance 1.9's consume_tokens refuses EOS on a finished grammar, consume_token takes it
            if not all(matcher.consume_token(t) for t in tokens) or matcher.is_error():  # EOS passes an errored one
                errors[i] = f"structured output: the grammar refused token(s) {tokens}: {matcher.get_error()}"
                continue
            spec = request.sampling_params.structured_outputs
            if not spec.jump_forward or had_drafts[i] or matcher.is_stopped():
                continue
            room = request.sampling_params.max_tokens - request.num_output_tokens - len(tokens)
            if self.max_model_len is not None:
                room = min(room, self.max_model_len - request.num_tokens - len(tokens))
            forced = matcher.compute_ff_tokens()[: max(room, 0)]
            if len(forced) < self.min_jump_forward_tokens:
                continue
            if not all(matcher.consume_token(t) for t in forced):
                errors[i] = f"structured output: the grammar refused its own forced tokens: {matcher.get_error()}"
                continue
            tokens.extend(forced)
            num_forced[i] = len(forced)
            self.num_forced_tokens += len(forced)
        return GrammarAdvance(num_forced, errors)

    @staticmethod
    def trim_drafts(requests: list[Request], drafts: list[list[int]]) -> None:
        """In place: cut each constrained request's draft at its first token the grammar refuses (the matcher is
        where the drafts start: after every token sampled so far)."""
        for request, draft in zip(requests, drafts):
            if request.grammar is not None and draft:
                del draft[request.grammar.validate_tokens(draft) :]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
