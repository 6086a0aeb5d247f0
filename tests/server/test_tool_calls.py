"""Tool calls through the real `openai` client against the real SmolLM2 (whose chat template knows no tools: the
server prompts it with them and reads Hermes-style calls): a required or named call always parses and validates
against the function's schema, streamed as tool_calls deltas the client assembles into the same calls; tool results
go back in; and refusals are OpenAI errors."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.real_model
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _check_calls(calls, names=None) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert out and (names is None or {n for n, _ in out} <= names)
    return out


def _streamed(stream) -> tuple[str, list, str]:
    """(content, tool calls assembled from their deltas as the OpenAI docs do, finish reason)."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                call["name"] += (part.function.name or "") if part.function else ""
                call["arguments"] += (part.function.arguments or "") if part.function else ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_call_parses_and_validates(openai_client, temperature):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=temperature,
        max_tokens=120, seed=3,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)


def test_named_call_and_single_call(openai_client):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=120, temperature=0,
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = _check_calls(reply.choices[0].message.tool_calls, {"get_time"})
    assert len(calls) == 1


def test_streamed_calls_equal_whole_calls(openai_client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    content, calls, reason = _streamed(openai_client.chat.completions.create(stream=True, **kwargs))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == _check_calls(whole.message.tool_calls)
    assert all(c["id"].startswith("call_") for c in calls)


def test_auto_reply_is_text_or_valid_calls_and_stream_agrees(openai_client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    content, calls, reason = _streamed(openai_client.chat.completions.create(stream=True, **kwargs))
    if whole.message.tool_calls:
        assert whole.finish_reason == reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
            (c["name"], c["arguments"]) for c in calls
        ]
    else:
        assert content == whole.message.content and not calls and reason == whole.finish_reason


def test_tool_results_go_back_in(openai_client):
    first = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0
    ).choices[0]
    call = first.message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=40, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason in ("stop", "length")


def test_tool_refusals_are_openai_errors(openai_client):
    cases = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), None),
        (dict(functions=[WEATHER["function"]]), "functions"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
            pytest.fail(f"not refused: {extra}")
        assert err.value.body["type"] == "invalid_request_error"
        if param is not None:
            assert err.value.body["param"] == param, err.value.body
