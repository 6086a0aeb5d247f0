"""The real `openai` client against a real server over the real SmolLM2: completions and chat, streamed and
not, n > 1, stop, logprobs, echo, usage. Streamed text must equal non-streamed text for the same seed."""

from __future__ import annotations

import math

import pytest

from tests.server.conftest import MODEL


def _stream_texts(stream, chat: bool) -> tuple[dict[int, str], dict[int, str], object]:
    """Join a stream's deltas per choice index; returns (texts, finish reasons, usage)."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_models_lists_the_served_model(openai_client):
    assert [m.id for m in openai_client.models.list().data] == [MODEL]


def test_chat_answers_and_stream_equals_non_stream(openai_client, real_llm):
    # "Answer in one word." keeps the first token clear of a near tie ("The" against "L") at every precision
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text and full.choices[0].message.role == "assistant"
    prompt_ids = real_llm.get_tokenizer().apply_chat_template(messages, tokenize=True)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    for seed in (None, 7):
        kwargs = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0 if seed is None else 0.9, seed=seed)
        whole = openai_client.chat.completions.create(**kwargs)
        texts, reasons, usage = _stream_texts(
            openai_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs),
            chat=True,
        )
        assert texts == {0: whole.choices[0].message.content}
        assert reasons == {0: whole.choices[0].finish_reason}
        assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_n_seed_stream_equals_non_stream(openai_client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=1.0, n=3, seed=123)
    whole = openai_client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) == 3  # seeded siblings differ
    texts, reasons, usage = _stream_texts(
        openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs), chat=False
    )
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens == 4  # counted once, not n times
    again = openai_client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]


def test_completions_several_prompts_and_token_prompts(openai_client, real_llm):
    tokenizer = real_llm.get_tokenizer()
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    whole = openai_client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[0].text == whole.choices[1].text  # greedy: both completions agree
    ids = openai_client.completions.create(
        model=MODEL, prompt=tokenizer.encode(prompts[1]), max_tokens=8, temperature=0
    )
    assert ids.choices[0].text == whole.choices[2].text


def test_stop_strings(openai_client):
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0)
    free = openai_client.completions.create(**kwargs).choices[0].text
    assert " 7," in free
    stopped = openai_client.completions.create(stop=[" 7,"], **kwargs).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(" 7,")]
    texts, reasons, _ = _stream_texts(openai_client.completions.create(stop=[" 7,"], stream=True, **kwargs), False)
    assert texts == {0: stopped.text} and reasons == {0: "stop"}


def test_completion_logprobs_and_echo(openai_client):
    out = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the most likely
        assert top[token] == pytest.approx(value)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]

    # Scoring the way lm-evaluation-harness does: echo the prompt with its logprobs.
    echo = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is Paris", max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    elp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith("The capital of France is Paris")
    assert elp.tokens[:6] == ["The", " capital", " of", " France", " is", " Paris"] and len(elp.tokens) == 6 + 1
    assert elp.token_logprobs[0] is None and all(v <= 0 for v in elp.token_logprobs[1:])
    # " Paris" scored as a prompt token equals its logprob as the first generated token after "... is".
    assert elp.token_logprobs[5] == pytest.approx(lp.top_logprobs[0][" Paris"], abs=1e-4)


def test_chat_logprobs(openai_client):
    out = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert "".join(item.token for item in content) == out.choices[0].message.content
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode() == item.token
        assert math.isfinite(item.logprob)


def test_errors_come_back_as_openai_errors(openai_client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
