"""Selection on the server, with the real `openai` client against the real SmolLM2: best_of (sample best_of, return
the n with the highest mean token logprob), the use_beam_search extension (HF's hypotheses, run beside other
requests, blocks freed on disconnect, a failure fails it alone), and the 400s for what neither can do."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL
from tests.server.test_safety import tiny_engine_factory  # noqa: F401 (a fixture)


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
    out = openai_client.completions.create(
        model=MODEL, prompt=["The sky is", "Water is"], n=2, best_of=3, max_tokens=6, temperature=0.9, seed=1
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_best_of_errors_are_400s(openai_client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match="must be >= n") as err:
        openai_client.completions.create(model=MODEL, prompt="hi", n=3, best_of=2, max_tokens=2)
    assert err.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        openai_client.completions.create(model=MODEL, prompt="hi", best_of=2, max_tokens=2, stream=True)
    # best_of equal to n is plain n, and streams.
    chunks = list(
        openai_client.completions.create(
            model=MODEL, prompt="hi", n=2, best_of=2, max_tokens=2, stream=True, temperature=0.5
        )
    )
    assert {choice.index for chunk in chunks for choice in chunk.choices} == {0, 1}


def test_beam_search_extension_matches_hf_beam_search(openai_client, real_llm, hf_smollm):
    import torch

    tok = real_llm.get_tokenizer()
    prompt = "The capital of France is"
    out = openai_client.completions.create(
        model=MODEL, prompt=prompt, n=2, best_of=4, max_tokens=12, extra_body={"use_beam_search": True}
    )
    eos = list(real_llm.llm_engine.eos_token_ids)
    ids = tok.encode(prompt)
    with torch.no_grad():
        ref = hf_smollm.generate(
            torch.tensor([ids]),
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    expected = [tok.decode(row[len(ids) :], skip_special_tokens=True) for row in ref.tolist()[:2]]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == expected and "Paris" in expected[0]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, extra_body={"use_beam_search": True})
    one_beam = openai_client.completions.create(**kwargs).choices[0].text  # n=1: one beam, i.e. greedy
    greedy = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert one_beam == greedy.choices[0].text
    assert openai_client.completions.create(echo=True, **kwargs).choices[0].text == prompt + one_beam


def test_beam_search_runs_beside_sampling_and_frees_on_disconnect(real_server, openai_client):
    import asyncio

    import aiohttp

    from tests.server.conftest import wait_until
    from tests.server.test_safety import _engine_is_idle, _read_events

    plain = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    alone = openai_client.completions.create(**plain).choices[0].text
    beam = {
        "model": MODEL,
        "prompt": "Write a long story about the sea.",
        "max_tokens": 24,
        "best_of": 3,
        "use_beam_search": True,
        "ignore_eos": True,
    }

    async def scenario(url: str):
        async with aiohttp.ClientSession() as session:

            async def post(body):
                async with session.post(url + "/v1/completions", json=body) as r:
                    return r.status, (await _read_events(r) if body.get("stream") else await r.json())

            results = await asyncio.gather(
                post(beam), post(plain | {"stream": True}), post(beam | {"n": 2}), post(plain)
            )
            # A client that gives up on a long beam search (2000 rounds: far longer than the wait below): its
            # beams' blocks must come back at once.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(
                    session.post(url + "/v1/completions", json=beam | {"max_tokens": 2000}), timeout=1.0
                )
            return results

    (s1, b1), (s2, events), (s3, b3), (s4, p4) = asyncio.run(scenario(real_server.url))
    assert s1 == s2 == s3 == s4 == 200
    assert len(b1["choices"]) == 1 and b1["usage"]["completion_tokens"] == 3 * 24  # best_of hypotheses counted
    assert [c["text"] for c in b3["choices"]][0] == b1["choices"][0]["text"] and len(b3["choices"]) == 2
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == alone == p4["choices"][0]["text"]
    wait_until(lambda: _engine_is_idle(real_server.engine), timeout_s=5)
    engine = real_server.engine.engine
    assert engine.stats().num_free_kv_blocks == engine.num_kv_blocks and not engine.has_unfinished_requests()


def test_beam_search_errors_are_400s(openai_client):
    openai = pytest.importorskip("openai")
    beam = {"use_beam_search": True}
    for kwargs, param in [
        (dict(stream=True), "stream"),
        (dict(logprobs=1), "logprobs"),
        (dict(stop=["."]), "stop"),
        (dict(n=3, best_of=2), "best_of"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=beam, **kwargs)
        assert err.value.body["param"] == param, err.value.body


def test_a_failing_beam_search_fails_alone(tiny_engine_factory):
    from tests.server.conftest import serve_engine, wait_until
    from tests.server.test_safety import POISON, _engine_is_idle, _request

    beam = {"model": MODEL, "max_tokens": 8, "n": 2, "use_beam_search": True, "ignore_eos": True}
    with serve_engine(tiny_engine_factory()) as server:
        status, _, body = _request(server.url, "/v1/completions", beam | {"prompt": [11, POISON, 13]})
        assert status == 500 and "poisoned token" in body["error"]["message"]
        wait_until(lambda: _engine_is_idle(server.engine))
        assert server.engine.engine.stats().num_free_kv_blocks == server.engine.engine.num_kv_blocks
        status, _, body = _request(server.url, "/v1/completions", beam | {"prompt": [11, 12, 13]})
        assert status == 200 and len(body["choices"]) == 2
        assert _request(server.url, "/health")[0] == 200
