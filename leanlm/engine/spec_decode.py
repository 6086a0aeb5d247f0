"""SpecDecoder: after each step, proposes the draft tokens every request verifies in the next one, and decides
how many: k adapts to each request's measured acceptance, and speculation switches off for large batches
(verification rows stop being nearly free) and for requests whose drafts are mostly rejected. Verification
itself is the scheduler's ordinary "compute these tokens" step plus the RejectionSampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.config import SpeculativeConfig
from leanlm.engine.proposer import DraftJob, Proposer, build_proposer
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
    num_failed_probes: int = 0  # probes in a row after which k stayed 0: each doubles the wait for the next

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted = _DECAY * self.accepted + num_accepted
        self.rejected = _DECAY * self.rejected + (1.0 if num_accepted < num_drafts else 0.0)


@dataclass
class _Mean:
    """A decayed running mean."""

    value: float = 0.0
    count: int = 0

    def add(self, x: float, decay: float = 0.9) -> None:
        self.value = x if self.count == 0 else decay * self.value + (1 - decay) * x
        self.count += 1


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
    """Owns the one Proposer the config chose (proposer.build_proposer), each request's acceptance estimate and
    the draft distributions that verification of model drafts needs."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
    ) -> None:
        """`proposer`: the model proposer a draft or self method needs; text methods build their own."""
        self.config = config
        self.proposer = build_proposer(config, proposer)
        self.block_size = block_size
        self.max_model_len = max_model_len
        # Step cost model: a draft model costs its weight-byte ratio per draft token until measured (below).
        self.draft_cost = config.draft_cost
        if self.draft_cost is None:
            self.draft_cost = self.proposer.relative_cost
        self.verify_overhead = config.verify_overhead
        # Measured seconds (decayed means) of a target decode forward and of one batched draft step: once both
        # are known they replace the weight-byte prior of a draft model's cost (Python overhead included).
        self._target_seconds = _Mean()
        self._draft_step_seconds = _Mean()
        self._acceptance: dict[str, _Acceptance] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}  # request id -> [k, V], random requests' model drafts
        self._num_steps = self._num_drafts = self._num_accepted = 0

    def stats(self) -> SpecStats:
        return SpecStats(self._num_steps, self._num_drafts, self._num_accepted)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)
            self._draft_probs.pop(request_id, None)
        self.proposer.forget(request_ids)

    def observe(
        self,
        requests: list[Request],
        verified: list[list[int]],
        num_accepted: list[int],
        predictions: list[list[int]] | None = None,
    ) -> None:
        """Record one step's verification: drafts verified and accepted per request, and (for Jacobi drafts)
        the target's argmax at each verified row. Call before the step's tokens are appended."""
        if any(verified):
            self._num_steps += 1
        for i, (request, drafts, accepted) in enumerate(zip(requests, verified, num_accepted)):
            if drafts:
                self._num_drafts += len(drafts)
                self._num_accepted += accepted
                self._acceptance.setdefault(request.request_id, _Acceptance()).observe(len(drafts), accepted)
                if predictions is not None:
                    inputs = [request.all_token_ids[-1], *drafts]
                    self.proposer.observe(request.request_id, inputs, predictions[i], accepted)

    def draft_probs(self, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor | None:
        """The draft distribution behind each verification row [sum(len(d) + 1), V] (zeros for greedy requests
        and bonus rows); None when every draft is certain (prompt lookup). Consumes what propose() stored."""
        stored = [self._draft_probs.pop(r.request_id, None) for r in requests]
        some = next((q for q in stored if q is not None), None)
        if some is None:
            return None  # every drafting request is greedy: the greedy rule needs no q
        rows = []
        for request, d, q in zip(requests, drafts, stored):
            if d and q is None and not request.sampling_params.is_greedy:
                raise RuntimeError(f"request {request.request_id!r}: sampled drafts without their distribution")
            block = torch.zeros(len(d) + 1, some.shape[-1], dtype=torch.float32, device=some.device)
            if q is not None and d:
                block[: len(d)] = q[: len(d)]  # the scheduler may have cut the drafts short
            rows.append(block)
        return torch.cat(rows)

    def propose(
        self, requests: list[Request], sampled: list[list[int]], block_ids: list[list[int]] | None = None
    ) -> list[list[int]]:
        """Drafts for the next step of each request that just got tokens (`sampled`, not yet appended). Model
        drafts write KV at the positions they take, so they stop where the request's blocks (`block_ids`) end."""
        out: list[list[int]] = [[] for _ in requests]
        if sum(1 for s in sampled if s) > self.config.max_batch_size:
            return out
        jobs: list[tuple[int, DraftJob]] = []
        for i, (request, new_tokens) in enumerate(zip(requests, sampled)):
            if not new_tokens or not self.can_speculate(request, len(new_tokens)):
                continue
            k = min(self.num_drafts(request.request_id), request.draft_room(self.max_model_len, len(new_tokens)))
            if k <= 0:
                continue
            if self.proposer.writes_kv:  # model drafts stop where the request's blocks end
                position = request.num_tokens + len(new_tokens) - 1
                k = min(k, len(block_ids[i]) * self.block_size - position)
            if k > 0:
                blocks = block_ids[i] if block_ids is not None else []  # only model drafts need them
                jobs.append((i, DraftJob(request, request.all_token_ids + new_tokens, k, blocks)))
        if jobs:
            drafts = self.proposer.propose([job for _, job in jobs])
            if drafts.step_seconds is not None:
                self._draft_step_seconds.add(drafts.step_seconds)
                self._update_draft_cost()
            for (i, job), tokens, q in zip(jobs, drafts.token_ids, drafts.probs):
                out[i] = tokens
                if q is not None:
                    self._draft_probs[job.request.request_id] = q
        return out

    def record_target_step(self, seconds: float) -> None:
        """The target's forward time for a decode or verification step."""
        self._target_seconds.add(seconds)

    def _update_draft_cost(self) -> None:
        if self.config.draft_cost is None and self._target_seconds.count >= 3 and self._draft_step_seconds.count >= 3:
            self.draft_cost = self._draft_step_seconds.value / self._target_seconds.value

    def num_drafts(self, request_id: str) -> int:
        """k maximizing expected tokens per unit cost, E(k) / C(k): E(k) = (1 - a^(k+1)) / (1 - a) tokens for
        per-draft acceptance a, C(k) = 1 + verify_overhead + draft_cost * k (C(0) = 1). At k = 0 a request
        proposes one draft again after probe_interval steps to re-measure, waiting twice as long after each probe
        that left k at 0 (up to 16 times)."""
        cfg = self.config
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        state = self._acceptance.setdefault(request_id, _Acceptance())
        a = min(state.rate, 0.999)
        best_k, best = 0, 1.0
        for k in range(1, cfg.num_speculative_tokens + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (1 + self.verify_overhead + self.draft_cost * k)
            if value > best:
                best_k, best = k, value
        if best_k == 0:
            state.steps_off += 1
            if state.steps_off < cfg.probe_interval << min(state.num_failed_probes, 4):
                return 0
            state.num_failed_probes += 1
            state.steps_off = 0
            return 1
        state.steps_off = state.num_failed_probes = 0
        return best_k

    @staticmethod
    def can_speculate(request: Request, num_new_tokens: int = 0) -> bool:
        """Penalties and min_tokens change the target distribution with every accepted token; such requests
        decode one token per step (their rows in a verification batch would need per-position settings)."""
        params = request.sampling_params
        has_penalty = params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
        return not has_penalty and request.num_output_tokens + num_new_tokens >= params.min_tokens
