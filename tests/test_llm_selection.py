"""LLM.best_of_n and LLM.majority_vote on the real bundled SmolLM2: one batched generate per call, selections
consistent with the samples, and argument errors before any generation."""

from __future__ import annotations

import re

import pytest

from leanlm import LLM, SamplingParams
from leanlm.selection import mean_logprob

ARITHMETIC = (
    "Question: What is 1 plus 1?\nAnswer: 2\nQuestion: What is 2 plus 3?\nAnswer: 5\n"
    "Question: What is 2 plus 2?\nAnswer:"
)
COUNTING = "Count: 1, 2, 3, 4, 5,"
ANSWER = r"^\s*(\d+)"

pytestmark = pytest.mark.real_model  # the bundled model throughout


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", progress=False, max_num_seqs=16)


def _free(llm) -> bool:
    engine = llm.llm_engine
    return not engine.has_unfinished_requests() and engine.stats().num_free_kv_blocks == engine.num_kv_blocks


def test_majority_vote_agrees_with_its_samples(llm):
    params = SamplingParams(temperature=0.7, max_tokens=4, seed=20, stop=["\n"])
    results = llm.majority_vote([ARITHMETIC, COUNTING], 12, params, ANSWER, use_tqdm=False)
    assert [r.answer for r in results] == ["4", "6"]
    for result in results:
        assert result.num_samples == 12
        # Recount from the winning samples and the counts: they say the same.
        assert all(re.match(ANSWER, c.text).group(1) == result.answer for c in result.completions)
        assert result.votes == len(result.completions) == max(n for _, n in result.counts)
        assert result.num_voting == sum(n for _, n in result.counts) <= 12
        assert result.support == pytest.approx(result.votes / result.num_voting)
        assert result.support > 0.5
    assert _free(llm)


def test_best_of_n_ranks_the_samples_by_mean_logprob(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    ranking = llm.best_of_n("Once upon a time", 4, params, use_tqdm=False)[0]
    assert len(ranking.ranked) == 4 and len({s.completion.text for s in ranking.ranked}) > 1
    scores = [s.score for s in ranking.ranked]
    assert scores == sorted(scores, reverse=True)
    assert all(s.score == pytest.approx(mean_logprob(s.completion)) for s in ranking.ranked)
    # A user scorer instead: the most tokens containing the letter 'e' wins.
    by_e = llm.best_of_n("Once upon a time", 4, params, scorer=lambda text, ids: text.count("e"), use_tqdm=False)[0]
    assert by_e.best.text.count("e") == max(s.completion.text.count("e") for s in by_e.ranked)
    assert by_e.best.logprobs is None  # a user scorer needs no logprobs, so none were asked for
    assert _free(llm)


def test_selection_arguments_are_checked_before_generating(llm):
    sampled = SamplingParams(temperature=0.7, max_tokens=2)
    with pytest.raises(ValueError, match="set temperature > 0"):
        llm.best_of_n("hi", 3, SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        llm.best_of_n("hi", 0, sampled)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        llm.majority_vote("hi", 2.5, sampled, ANSWER)
    with pytest.raises(ValueError, match="disagrees with k=4"):
        llm.majority_vote("hi", 4, SamplingParams(n=2, temperature=0.7), ANSWER)
    with pytest.raises(ValueError, match="does not compile"):
        llm.majority_vote("hi", 2, sampled, r"(\d+")
    assert _free(llm)
    # n = 1 with greedy decoding is allowed: one sample needs no diversity.
    assert len(llm.best_of_n("hi", 1, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0].ranked) == 1
