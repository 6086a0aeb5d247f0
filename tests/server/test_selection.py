"""Selection on the server, with the real `openai` client against the real SmolLM2: best_of (sample best_of, return
the n with the highest mean token logprob) and the 400s for what it cannot do."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL


def _mean(choice) -> float:
    lps = choice.logprobs.token_logprobs
    return sum(lps) / len(lps)


def test_best_of_returns_the_n_most_likely_samples(openai_client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=5)
    # Seeded completion i uses seed + i, so n=4 shows exactly the candidates best_of=4 chooses from.
    candidates = openai_client.completions.create(n=4, logprobs=0, **kwargs)
    assert len({c.text for c in candidates.choices}) == 4
    expected = sorted(candidates.choices, key=lambda c: -_mean(c))[:2]

    best = openai_client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in expected]
    assert all(c.logprobs is None for c in best.choices)  # sampled with logprobs, but none were asked for
    assert best.usage.completion_tokens == candidates.usage.completion_tokens  # every sample counts, as OpenAI's

    with_logprobs = openai_client.completions.create(n=1, best_of=4, logprobs=1, **kwargs)
    choice = with_logprobs.choices[0]
    assert choice.text == expected[0].text and _mean(choice) == pytest.approx(_mean(expected[0]), abs=1e-5)
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_best_of_with_several_prompts_indexes_choices_per_prompt(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], n=2, best_of=3,
                                           max_tokens=6, temperature=0.9, seed=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_best_of_errors_are_400s(openai_client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="must be >= n") as err:
        openai_client.completions.create(model=MODEL, prompt="hi", n=3, best_of=2, max_tokens=2)
    assert err.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        openai_client.completions.create(model=MODEL, prompt="hi", best_of=2, max_tokens=2, stream=True)
    # best_of equal to n is plain n, and streams.
    chunks = list(openai_client.completions.create(model=MODEL, prompt="hi", n=2, best_of=2, max_tokens=2,
                                                   stream=True, temperature=0.5))
    assert {choice.index for chunk in chunks for choice in chunk.choices} == {0, 1}
