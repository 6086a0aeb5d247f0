"""Selection among sampled completions of one prompt: best-of-N (ranked by mean token logprob or a user score)
and majority vote / self-consistency (Wang et al., 2022: sample k reasoning paths, extract each one's answer,
keep the most frequent). Pure functions over CompletionOutputs; generation lives in LLM and the server."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from leanlm.engine import CompletionOutput
from leanlm.sampling_params import SamplingParams

# A user score of one completion: (text, generated token ids) -> higher is better.
Scorer = Callable[[str, list[int]], float]
# What majority_vote extracts answers with: a regex (its first group if it has one, else the whole match) or a
# callable text -> answer, None when the sample has no parseable answer (it then does not vote).
Extractor = str | re.Pattern | Callable[[str], Hashable | None]


def mean_logprob(completion: CompletionOutput) -> float:
    """The completion's mean token logprob (its cumulative logprob / its length); -inf for an empty one, so it
    ranks last. Needs the completion generated with logprobs (SamplingParams(logprobs=0) is enough)."""
    if completion.logprobs is None:
        raise ValueError(
            "scoring by mean logprob needs per-token logprobs; generate with SamplingParams(logprobs=0) "
            "or pass a scorer"
        )
    if not completion.token_ids:
        return -math.inf
    return completion.cumulative_logprob / len(completion.token_ids)


@dataclass(frozen=True)
class ScoredCompletion:
    completion: CompletionOutput
    score: float  # mean token logprob, or the user scorer's value; higher is better


@dataclass(frozen=True)
class Ranking:
    """best_of's result: every completion with its score, best first."""

    ranked: tuple[ScoredCompletion, ...]  # best first; equal scores keep the input order

    @property
    def best(self) -> CompletionOutput:
        return self.ranked[0].completion

    @property
    def score(self) -> float:
        return self.ranked[0].score

    def top(self, n: int) -> list[CompletionOutput]:
        return [s.completion for s in self.ranked[:n]]


def best_of(completions: Sequence[CompletionOutput], scorer: Scorer | None = None) -> Ranking:
    """Rank completions by mean token logprob (default) or by `scorer(text, token_ids)`. Ties keep the input
    order (the sort is stable), so the result is deterministic."""
    completions = _check_completions(completions)
    scored = []
    for completion in completions:
        if scorer is None:
            score = mean_logprob(completion)
        else:
            score = scorer(completion.text, list(completion.token_ids))
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise TypeError(
                    f"the scorer must return a number, got {type(score).__name__} for completion {completion.index}"
                )
            if math.isnan(score):
                raise ValueError(
                    f"the scorer returned NaN for completion {completion.index}; return a number "
                    f"that orders completions (higher is better)"
                )
        scored.append(ScoredCompletion(completion, float(score)))
    return Ranking(tuple(sorted(scored, key=lambda s: -s.score)))


@dataclass(frozen=True)
class VoteResult:
    """majority_vote's result for one prompt."""

    answer: Hashable | None  # the winning answer; None when no sample gave a parseable answer
    support: float  # the winner's votes / the samples that voted (0.0 when none voted)
    counts: tuple[tuple[Hashable, int], ...]  # (answer, votes) for every answer, in the tie-break order
    completions: tuple[CompletionOutput, ...]  # the samples whose answer is the winner, in input order
    num_voting: int  # samples with a parseable answer
    num_samples: int  # all samples

    @property
    def votes(self) -> int:
        return self.counts[0][1] if self.counts else 0


def make_extractor(extract: Extractor) -> Callable[[str], Hashable | None]:
    """The answer extractor for `extract`; a regex is compiled here, so a bad one fails before any generation."""
    if isinstance(extract, str):
        try:
            extract = re.compile(extract)
        except re.error as exc:
            raise ValueError(f"the answer regex {extract!r} does not compile: {exc}") from None
    if isinstance(extract, re.Pattern):
        pattern = extract

        def from_regex(text: str) -> str | None:
            match = pattern.search(text)
            if match is None:
                return None
            answer = match.group(1) if pattern.groups else match.group(0)
            # An optional group that did not take part, or one that caught only blanks, is no answer.
            return answer.strip() or None if answer is not None else None

        return from_regex
    if callable(extract):
        return extract
    raise TypeError(
        f"extract must be a regex (str or re.Pattern) or a callable text -> answer, got {type(extract).__name__}"
    )


def majority_vote(completions: Sequence[CompletionOutput], extract: Extractor) -> VoteResult:
    """Extract each completion's answer and vote; samples without an answer do not vote.

    Ties in votes go to the answer whose best sample has the highest mean token logprob (when every completion
    has logprobs), then to the answer seen first. `counts` lists the answers in that order."""
    completions = _check_completions(completions)
    extractor = make_extractor(extract)
    voters: dict[Hashable, list[CompletionOutput]] = {}  # answer -> its samples; dicts keep first-seen order
    for completion in completions:
        answer = extractor(completion.text)
        if answer is None:
            continue
        try:
            voters.setdefault(answer, []).append(completion)
        except TypeError:
            raise TypeError(
                f"answers must be hashable (str, int, tuple, ...), the extractor returned {type(answer).__name__}"
            ) from None
    has_logprobs = all(c.logprobs is not None for c in completions)

    def best_logprob(samples: list[CompletionOutput]) -> float:
        return max(mean_logprob(c) for c in samples) if has_logprobs else 0.0

    # Stable sort over first-seen order: most votes, then the best sample's mean logprob, then first seen.
    order = sorted(voters, key=lambda a: (-len(voters[a]), -best_logprob(voters[a])))
    counts = tuple((answer, len(voters[answer])) for answer in order)
    num_voting = sum(n for _, n in counts)
    if not order:
        return VoteResult(None, 0.0, (), (), 0, len(completions))
    winner = order[0]
    return VoteResult(
        winner, len(voters[winner]) / num_voting, counts, tuple(voters[winner]), num_voting, len(completions)
    )


def sampling_params_for_samples(
    num: int, name: str, params: SamplingParams | None, needs_logprobs: bool
) -> SamplingParams:
    """`params` asking for `num` samples per prompt (one request with n=num: the samples share the prompt's KV
    blocks), with logprobs when the selection scores by them. `name` is the argument's name in messages."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {num!r}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"sampling_params must be one SamplingParams (it applies to every prompt), got {type(params).__name__}"
        )
    if params.n not in (1, num):
        raise ValueError(f"sampling_params.n={params.n} disagrees with {name}={num}; leave n at 1")
    if num > 1 and params.is_greedy:
        raise ValueError(
            f"greedy decoding (temperature {params.temperature}) makes all {num} samples identical; "
            f"set temperature > 0 (e.g. 0.7) to select among different samples"
        )
    logprobs = params.logprobs if params.logprobs is not None or not needs_logprobs else 0
    return dataclasses.replace(params, n=num, logprobs=logprobs)


def _check_completions(completions: Sequence[CompletionOutput]) -> list[CompletionOutput]:
    completions = list(completions)
    if not completions:
        raise ValueError("no completions to select from; generate at least one sample")
    failed = [c.index for c in completions if c.finish_reason in ("error", "abort")]
    if failed:
        raise ValueError(f"completions {failed} did not finish (error or abort); select among finished ones")
    return completions
