"""SpecDecoder: after each step, proposes the draft tokens every request verifies in the next one, and decides
how many: k adapts to each request's measured acceptance, and speculation switches off for large batches
(verification rows stop being nearly free) and for requests whose drafts are mostly rejected. Verification
itself is the scheduler's ordinary "compute these tokens" step plus the RejectionSampler."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.config import SpeculativeConfig
from leanlm.engine.ngram_proposer import NgramProposer
from leanlm.engine.request import Request

# Prior for a request's acceptance estimate: as if this many drafts had been seen, at this rate.
_PRIOR_DRAFTS = 4.0
_PRIOR_RATE = 0.6
_DECAY = 0.9  # weight of history per verified step: the estimate follows the text as it changes


@dataclass
class _Acceptance:
    """Decayed counts of one request's verified drafts (per-draft acceptance is modeled as a coin flip,
    so a step with a accepted of k drafts is a successes and one failure when a < k)."""

    accepted: float = _PRIOR_DRAFTS * _PRIOR_RATE
    rejected: float = _PRIOR_DRAFTS * (1 - _PRIOR_RATE)
    steps_off: int = 0  # consecutive steps at k = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted = _DECAY * self.accepted + num_accepted
        self.rejected = _DECAY * self.rejected + (1.0 if num_accepted < num_drafts else 0.0)


@dataclass(frozen=True)
class SpecStats:
    """Totals since the engine started."""

    num_steps: int  # steps that verified at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._acceptance: dict[str, _Acceptance] = {}
        self._num_steps = self._num_drafts = self._num_accepted = 0

    def stats(self) -> SpecStats:
        return SpecStats(self._num_steps, self._num_drafts, self._num_accepted)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)

    def observe(self, requests: list[Request], verified: list[list[int]], num_accepted: list[int]) -> None:
        """Record one step's verification: drafts verified and accepted per request."""
        if any(verified):
            self._num_steps += 1
        for request, drafts, accepted in zip(requests, verified, num_accepted):
            if drafts:
                self._num_drafts += len(drafts)
                self._num_accepted += accepted
                self._acceptance.setdefault(request.request_id, _Acceptance()).observe(len(drafts), accepted)

    def propose(self, requests: list[Request], sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for the next step of each request that just got tokens (`sampled`, not yet appended)."""
        out: list[list[int]] = [[] for _ in requests]
        if sum(1 for s in sampled if s) > self.config.max_batch_size:
            return out
        for i, (request, new_tokens) in enumerate(zip(requests, sampled)):
            if new_tokens and self.can_speculate(request, len(new_tokens)):
                k = self.num_drafts(request.request_id)
                if k:
                    out[i] = self.proposer.propose(request.all_token_ids + new_tokens, k)
        return out

    def num_drafts(self, request_id: str) -> int:
        """k maximizing expected tokens per unit cost, E(k) / C(k): E(k) = (1 - a^(k+1)) / (1 - a) tokens for
        per-draft acceptance a, C(k) = 1 + verify_overhead + draft_cost * k (C(0) = 1). At k = 0 a request
        proposes again after probe_interval steps, to re-measure."""
        cfg = self.config
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        state = self._acceptance.setdefault(request_id, _Acceptance())
        a = min(state.rate, 0.999)
        best_k, best = 0, 1.0
        for k in range(1, cfg.num_speculative_tokens + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (1 + cfg.verify_overhead + cfg.draft_cost * k)
            if value > best:
                best_k, best = k, value
        if best_k == 0:
            state.steps_off += 1
            if state.steps_off < cfg.probe_interval:
                return 0
            best_k = 1
        state.steps_off = 0
        return best_k

    @staticmethod
    def can_speculate(request: Request, num_new_tokens: int = 0) -> bool:
        """Penalties and min_tokens change the target distribution with every accepted token; such requests
        decode one token per step (their rows in a verification batch would need per-position settings)."""
        params = request.sampling_params
        has_penalty = params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        return not has_penalty and request.num_output_tokens + num_new_tokens >= params.min_tokens
