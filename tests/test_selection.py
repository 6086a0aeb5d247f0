"""Selection logic alone, on hand-made CompletionOutputs: best-of-N ranking (mean logprob, user scorers, ties)
and majority vote (regex and callable extractors, unparseable samples, tie-breaking)."""

from __future__ import annotations

import math
import re

import pytest

from leanlm.engine.outputs import CompletionOutput
from leanlm.selection import best_of, majority_vote, make_extractor, mean_logprob


def _completion(
    index: int, text: str, token_logprobs: list[float] | None = None, finish_reason: str = "stop"
) -> CompletionOutput:
    """A completion whose token i is id 100 + i with the given logprob (None: generated without logprobs)."""
    lps = token_logprobs if token_logprobs is not None else [-1.0] * 3
    token_ids = [100 + i for i in range(len(lps))]
    logprobs = None if token_logprobs is None else [{t: lp} for t, lp in zip(token_ids, lps)]
    return CompletionOutput(index, text, token_ids, logprobs, finish_reason)


def test_mean_logprob_is_cumulative_over_length():
    assert mean_logprob(_completion(0, "a", [-1.0, -2.0, -3.0])) == pytest.approx(-2.0)
    assert mean_logprob(_completion(0, "", [])) == -math.inf
    with pytest.raises(ValueError, match="logprobs=0"):
        mean_logprob(_completion(0, "a"))


def test_best_of_ranks_by_mean_logprob_not_sum():
    short_bad = _completion(0, "x", [-2.0])  # sum -2, mean -2
    long_good = _completion(1, "y", [-0.5] * 6)  # sum -3, mean -0.5
    middle = _completion(2, "z", [-1.0, -1.0])
    ranking = best_of([short_bad, long_good, middle])
    assert [s.completion.index for s in ranking.ranked] == [1, 2, 0]
    assert ranking.best is long_good and ranking.score == pytest.approx(-0.5)
    assert [c.index for c in ranking.top(2)] == [1, 2]


def test_best_of_ties_keep_input_order():
    ranking = best_of([_completion(i, str(i), [-1.0, -1.0]) for i in range(4)])
    assert [s.completion.index for s in ranking.ranked] == [0, 1, 2, 3]


def test_best_of_with_a_callable_scorer():
    completions = [_completion(0, "short"), _completion(1, "much longer text"), _completion(2, "mid text")]
    seen = []

    def by_length(text: str, token_ids: list[int]) -> float:
        seen.append(token_ids)
        return len(text)

    ranking = best_of(completions, by_length)
    assert [s.completion.text for s in ranking.ranked] == ["much longer text", "mid text", "short"]
    assert seen[0] == [100, 101, 102]  # token ids reach the scorer; no logprobs needed
    with pytest.raises(TypeError, match="must return a number"):
        best_of(completions, lambda text, ids: "high")
    with pytest.raises(ValueError, match="NaN"):
        best_of(completions, lambda text, ids: float("nan"))


def test_best_of_refuses_empty_and_failed_input():
    with pytest.raises(ValueError, match="no completions"):
        best_of([])
    with pytest.raises(ValueError, match=r"completions \[1\] did not finish"):
        best_of([_completion(0, "a", [-1.0]), _completion(1, "b", [-1.0], finish_reason="abort")])


def test_majority_vote_with_a_regex_group():
    texts = ["The answer is 12.", "I think 13", "so 12", "no idea", "12 it is", "answer: 13"]
    result = majority_vote([_completion(i, t) for i, t in enumerate(texts)], r"(\d+)")
    assert result.answer == "12" and result.votes == 3
    assert result.counts == (("12", 3), ("13", 2))
    assert result.num_voting == 5 and result.num_samples == 6  # "no idea" did not vote
    assert result.support == pytest.approx(3 / 5)
    assert [c.index for c in result.completions] == [0, 2, 4]


def test_majority_vote_regex_without_group_uses_the_whole_match():
    result = majority_vote(
        [_completion(0, "x = 4"), _completion(1, "x = 4 "), _completion(2, "x = 5")], re.compile(r"x = \d")
    )
    assert result.answer == "x = 4" and result.support == pytest.approx(2 / 3)


def test_majority_vote_with_a_callable_and_nobody_voting():
    def last_word_if_yes_no(text: str):
        word = text.split()[-1].lower()
        return word if word in ("yes", "no") else None

    texts = ["Yes", "maybe", "well, no", "I say yes"]
    result = majority_vote([_completion(i, t) for i, t in enumerate(texts)], last_word_if_yes_no)
    assert result.answer == "yes" and result.counts == (("yes", 2), ("no", 1)) and result.num_voting == 3
    nobody = majority_vote([_completion(0, "maybe"), _completion(1, "perhaps")], last_word_if_yes_no)
    assert nobody.answer is None and nobody.support == 0.0 and nobody.counts == () and nobody.completions == ()
    assert nobody.num_samples == 2


def test_majority_vote_ties_go_to_the_most_likely_sample_then_first_seen():
    # 'a' and 'b' have two votes each; b's best sample has the higher mean logprob.
    samples = [
        _completion(0, "a", [-1.0]),
        _completion(1, "b", [-3.0]),
        _completion(2, "a", [-2.0]),
        _completion(3, "b", [-0.5]),
        _completion(4, "c", [-0.1]),
    ]
    result = majority_vote(samples, r"([abc])")
    assert result.answer == "b" and result.counts == (("b", 2), ("a", 2), ("c", 1))
    assert result.support == pytest.approx(2 / 5)
    # Without logprobs the first answer seen wins the tie.
    plain = [_completion(i, t) for i, t in enumerate(["a", "b", "b", "a"])]
    assert majority_vote(plain, r"([ab])").answer == "a"


def test_bad_extractors_fail_clearly():
    with pytest.raises(ValueError, match="does not compile"):
        make_extractor(r"(\d+")
    with pytest.raises(TypeError, match="regex .* or a callable"):
        make_extractor(42)
    with pytest.raises(TypeError, match="hashable"):
        majority_vote([_completion(0, "a")], lambda text: [text])
