"""Beam search (beam width, length penalty, early stopping: the rules of HF transformers' `_beam_search`) over
the engine's own requests, on copy-on-write shared KV blocks, so the prompt and shared prefixes are computed once.

Design. A beam is one engine request per round: it computes one token (max_tokens = its output length + 1),
returns its top-C logprobs (raw log-softmax), and, made with `keeps_kv`, keeps its blocks once finished. When
every beam of a prompt has finished the round, the search ranks the candidates and starts each next beam as a
fork of its parent (`Scheduler.fork_request`): a new request with the parent's tokens, the last (greedy, unused)
one replaced by the chosen token, and the parent's computed tokens and blocks; then the parents release theirs.
The chosen token goes into the parent's partially filled last block, so every fork but the last to run copies
that one block (`SchedulerOutput.blocks_to_copy`); the prefix stays shared. One-token rounds keep
`LLMEngine.step()` as it is (schedule, execute, update), and chunked prefill, prefix caching and preemption
work on beams as on any request. Long-lived beam requests would instead need the scheduler to stop each one at
the end of a round until its siblings catch up (a preempted sibling recomputes for several steps).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tqdm.auto import tqdm

from leanlm.engine.engine import LLMEngine
from leanlm.engine.request import Request, RequestStatus
from leanlm.sampling_params import GREEDY_TEMPERATURE_EPS, MAX_LENGTH_PENALTY, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """Settings of one beam search (vLLM's names). Validated on construction."""

    beam_width: int  # beams kept per step, and hypotheses returned per prompt
    max_tokens: int = 16  # most tokens generated per hypothesis
    # Score = cumulative logprob / generated tokens ** length_penalty (HF): > 0 favours longer hypotheses.
    length_penalty: float = 1.0
    # True: stop once beam_width hypotheses ended. False: also stop when the best live beam, scored at its
    # current length, cannot beat the worst of beam_width ended hypotheses (HF's heuristic).
    early_stopping: bool = False
    ignore_eos: bool = False  # EOS is then an ordinary token: every hypothesis runs to max_tokens
    temperature: float = 0.0  # beam search is deterministic; accepted (as 0) for vLLM compatibility
    skip_special_tokens: bool = True  # in the returned texts

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not abs(penalty) <= MAX_LENGTH_PENALTY:
            raise ValueError(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] (1.0 scores the "
                f"average logprob), got {penalty!r}"
            )
        if not isinstance(self.early_stopping, bool):
            raise ValueError(f"early_stopping must be True or False, got {self.early_stopping!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature >= GREEDY_TEMPERATURE_EPS:
            raise ValueError(
                f"beam search keeps the most likely beams and samples nothing, so temperature must be 0, got "
                f"{self.temperature!r}; to sample several completions use LLM.generate with SamplingParams(n=...)"
            )


@dataclass
class BeamSearchSequence:
    """One hypothesis: generated tokens (the EOS that ended it included) and how they scored."""

    token_ids: list[int]  # generated tokens, prompt excluded
    text: str  # token_ids decoded (special tokens skipped unless skip_special_tokens=False)
    cumulative_logprob: float  # sum of the tokens' logprobs under the model
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # 'stop' (ended by EOS) or 'length' (max_tokens or the context limit)


@dataclass
class BeamSearchOutput:
    """The result of one prompt: up to beam_width hypotheses, best score first."""

    prompt: str | None  # the prompt's text, None when it was given as token ids
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best score first


class _Hypothesis(NamedTuple):
    """An ended beam."""

    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    token_ids: list[int]
    cumulative_logprob: float


@dataclass
class _Beam:
    """A live beam: its request for this round (which holds its tokens and KV) and its cumulative logprob."""

    request: Request
    cumulative_logprob: float


@dataclass
class _Group:
    """One prompt's search. Invariant: while unfinished, every live beam's request is in the engine, or
    finished with its KV held until the round is decided."""

    index: int  # the prompt's position in the input
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int  # params.max_tokens, capped by the context
    beams: list[_Beam] = field(default_factory=list)
    finished: list[_Hypothesis] = field(default_factory=list)  # at most beam_width, best first
    num_generated: int = 0  # tokens in every live beam
    is_done: bool = False


class BeamSearch:
    """Drives beam searches through one LLMEngine: `add` prompts, call `step` until `has_unfinished` is
    False (each `step` is one engine step and returns the outputs that finished), or `abort` to drop them all.
    Groups run concurrently as long as their beams fit in max_num_seqs."""

    def __init__(self, engine: LLMEngine, params: BeamSearchParams, request_id_prefix: str = "beam") -> None:
        """`request_id_prefix` starts the ids of the beams' requests; searches that share an engine need
        different ones (the async engine uses each search's request id)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam search takes a BeamSearchParams, got {type(params).__name__}")
        max_num_seqs = engine.engine_config.max_num_seqs
        if params.beam_width > max_num_seqs:
            raise ValueError(
                f"beam_width={params.beam_width} beams cannot run at once with max_num_seqs={max_num_seqs}; "
                f"raise max_num_seqs or lower beam_width"
            )
        self.engine = engine
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else engine.eos_token_ids)
        # Candidates per step: HF keeps max(2, 1 + #EOS) * beam_width, so that beam_width live beams remain
        # even when the best candidates all end in EOS (2 * beam_width with one EOS id).
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.max_groups = max_num_seqs // params.beam_width  # groups whose beams run at once
        self._waiting: deque[_Group] = deque()
        self._active: list[_Group] = []
        self._ids = itertools.count()
        self.request_id_prefix = request_id_prefix
        self._request_ids: set[str] = set()  # requests submitted and not yet released: abort() ends them

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._active)

    def add(self, prompt: str | list[int], index: int) -> None:
        """Queue one prompt (text or token ids); `index` names it in the output."""
        text, token_ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate(token_ids, self._round_params(0))
        max_tokens = min(self.params.max_tokens, self.engine.max_model_len - len(token_ids))
        self._waiting.append(_Group(index, text, token_ids, max_tokens))

    def step(self) -> list[tuple[int, BeamSearchOutput]]:
        """Start waiting groups that fit, run one engine step, decide the rounds that completed. Returns
        (index, output) of the groups that finished."""
        self.admit()
        if not self._active:
            return []
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("beam search lost its requests: every live beam must be running or waiting")
        self.engine.step()  # beams are not in the OutputProcessor: their results are read off their requests
        return self.collect()

    def admit(self) -> None:
        """Start the waiting groups that fit: their first round's requests enter the scheduler. `step` calls it;
        a caller that runs the engine's steps itself (the async engine, among other requests) calls admit
        before and collect after each engine step."""
        while self._waiting and len(self._active) < self.max_groups:
            group = self._waiting.popleft()
            request = self._new_request(group)
            self.engine.add_prepared_request(request)
            self._request_ids.add(request.request_id)
            group.beams = [_Beam(request, 0.0)]
            self._active.append(group)

    def collect(self) -> list[tuple[int, BeamSearchOutput]]:
        """After an engine step: decide the rounds that completed (forking the next beams). Returns (index,
        output) of the groups that finished. On a failed beam it aborts every search and raises."""
        done = []
        for group in self._active:
            if all(beam.request.is_finished for beam in group.beams):
                self._advance(group)
                if group.is_done:
                    done.append((group.index, self._output(group)))
        self._active = [g for g in self._active if not g.is_done]
        return done

    def abort(self) -> None:
        """Drop every search: abort running beams and release the blocks of finished ones."""
        for request_id in self._request_ids:
            self.engine.drop_request(request_id)
        self._request_ids.clear()
        self._active.clear()
        self._waiting.clear()

    def run(self, prompts: Sequence[str | list[int]], use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Every prompt to completion; outputs in input order. Every prompt is tokenized and validated before
        anything runs, and all blocks are freed even when interrupted."""
        for index, prompt in enumerate(prompts):
            self.add(prompt, index)
        outputs: dict[int, BeamSearchOutput] = {}
        bar = tqdm(total=len(prompts), desc="Beam search", unit="req", disable=not use_tqdm, leave=False)
        try:
            while self.has_unfinished():
                for index, output in self.step():
                    outputs[index] = output
                    bar.update(1)
        except BaseException:
            self.abort()  # never leave beams holding KV blocks behind
            raise
        finally:
            bar.close()
        return [outputs[i] for i in range(len(prompts))]

    # ---- one round -----------------------------------------------------------------------------------

    def _advance(self, group: _Group) -> None:
        """All beams computed their round: rank the candidates, end hypotheses, fork the next beams."""
        for beam in group.beams:
            if beam.request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
                self.abort()
                raise RuntimeError(
                    f"beam search on prompt {group.index} failed: request {beam.request.request_id} ended "
                    f"{beam.request.status.value}: {beam.request.error}"
                )
        group.num_generated += 1
        width = self.params.beam_width
        is_last = group.num_generated >= group.max_tokens
        # (cumulative logprob, beam, token), best first; sorted() is stable: ties keep beam then rank order.
        candidates = []
        for beam in group.beams:
            top = sorted(beam.request.output_logprobs[-1].items(), key=lambda kv: -kv[1])[: self.num_candidates]
            candidates.extend((beam.cumulative_logprob + lp, beam, token_id) for token_id, lp in top)
        candidates = sorted(candidates, key=lambda c: -c[0])[: self.num_candidates]
        next_beams: list[tuple[float, _Beam, int]] = []
        for rank, (cum, beam, token_id) in enumerate(candidates):
            ends = is_last or token_id in self.eos_token_ids
            if not ends:
                if len(next_beams) < width:
                    next_beams.append((cum, beam, token_id))
            elif rank < width:  # only the top beam_width candidates may end; the rest are spares
                tokens = _tokens_with(beam.request, token_id)
                group.finished.append(_Hypothesis(cum / len(tokens) ** self.params.length_penalty, tokens, cum))
        group.finished = sorted(group.finished, key=lambda h: -h.score)[:width]
        group.is_done = is_last or not next_beams or self._cannot_improve(group, next_beams[0][0])
        old_beams = group.beams
        group.beams = [] if group.is_done else [self._fork(group, b, token_id, cum) for cum, b, token_id in next_beams]
        for beam in old_beams:  # after the forks took their references
            self.engine.release_kv(beam.request.request_id)
            self._request_ids.discard(beam.request.request_id)

    def _cannot_improve(self, group: _Group, best_live_cum: float) -> bool:
        """beam_width hypotheses ended and (early_stopping, or HF's heuristic) the best live beam, scored at its
        current length, does not beat the worst of them."""
        if len(group.finished) < self.params.beam_width:
            return False
        if self.params.early_stopping:
            return True
        return best_live_cum / group.num_generated**self.params.length_penalty <= group.finished[-1].score

    def _fork(self, group: _Group, parent: _Beam, token_id: int, cumulative_logprob: float) -> _Beam:
        """The parent's tokens with its sampled last token replaced by `token_id`; KV shared up to it."""
        child = self._new_request(group)
        child.append_output_token_ids(_tokens_with(parent.request, token_id))
        # the KV of every token but the new one (none when the held parent's blocks were evicted)
        self.engine.fork_request(parent.request, child, child.num_tokens - 1)
        self._request_ids.add(child.request_id)
        return _Beam(child, cumulative_logprob)

    def _new_request(self, group: _Group) -> Request:
        return Request(
            f"{self.request_id_prefix}-{group.index}-{next(self._ids)}",
            group.prompt_token_ids,
            self._round_params(group.num_generated),
            device=self.engine.device,
            keeps_kv=True,
        )

    def _round_params(self, num_generated: int) -> SamplingParams:
        """One more token than the beam has, greedy (the pick is ignored), with the candidates' logprobs."""
        return SamplingParams(
            max_tokens=num_generated + 1,
            temperature=0.0,
            ignore_eos=True,
            logprobs=self.num_candidates,
        )

    def _output(self, group: _Group) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        sequences = [
            BeamSearchSequence(
                token_ids=tokens,
                text=tokenizer.decode(tokens, skip_special_tokens=self.params.skip_special_tokens),
                cumulative_logprob=cum,
                score=score,
                finish_reason="stop" if tokens[-1] in self.eos_token_ids else "length",
            )
            for score, tokens, cum in group.finished
        ]
        return BeamSearchOutput(group.prompt, group.prompt_token_ids, sequences)


def _tokens_with(request: Request, token_id: int) -> list[int]:
    """A finished round's generated tokens with its (greedy, unused) last token replaced by `token_id`."""
    return request.output_token_ids[:-1] + [token_id]
