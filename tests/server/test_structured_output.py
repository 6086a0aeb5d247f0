"""Structured output over HTTP: OpenAI's response_format (json_object, json_schema), vLLM's structured_outputs and
guided_* fields, on both endpoints; malformed, conflicting, oversized or uncompilable specs are a 400 that leaves the
engine idle. With the real SmolLM2 and the real `openai` client: schema-valid JSON, streamed and not, and `parse`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.conftest import MODEL, serve_engine
from tests.server.test_safety import _assert_error, _engine_is_idle, _request, tiny_engine_factory  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "temperature_c": {"type": "integer", "minimum": -90, "maximum": 60},
    },
    "required": ["city", "temperature_c"],
    "additionalProperties": False,
}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # the random tiny model would pick whitespace for ever
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 100, "temperature": 0}


def test_every_way_to_ask_for_a_format_constrains_the_output(tiny_engine_factory):
    schema = SCHEMA | COMPACT
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}, "json"),
        ({"structured_outputs": {"json": schema}}, "json"),
        ({"guided_json": schema}, "json"),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}, "regex"),
        ({"guided_regex": "[0-9]{3}-[a-c]{2}"}, "regex"),
        ({"structured_outputs": {"choice": ["north", "south"]}}, "choice"),
        ({"guided_choice": ["north", "south"]}, "choice"),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, "grammar"),
        ({"structured_outputs": {"grammar": 'start: "a" ("," "a")*', "jump_forward": False}, "max_tokens": 6}, "lark"),
    ]
    checks = {
        "json": lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        "regex": lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t),
        "choice": lambda t: t in ("north", "south"),
        "grammar": lambda t: t in ("yes", "no"),
        "lark": lambda t: re.fullmatch("a(,a)*,?", t),  # max_tokens may cut it after a comma
    }
    with serve_engine(tiny_engine_factory()) as server:
        for fields, kind in cases:
            status, _, body = _request(server.url, "/v1/chat/completions", CHAT | fields)
            assert status == 200, body
            assert checks[kind](body["choices"][0]["message"]["content"]), (fields, body)
            status, _, body = _request(server.url, "/v1/completions", COMPLETION | fields)
            assert status == 200, body
            assert checks[kind](body["choices"][0]["text"]), (fields, body)
        assert _engine_is_idle(server.engine)


def test_bad_formats_are_a_400_naming_the_field(tiny_engine_factory):
    too_big = {"type": "object", "description": "x" * (64 << 10)}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}}, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_json": too_big}, "guided_json"),
        ({"guided_grammar": "start: nothing_defined"}, None),
    ]
    with serve_engine(tiny_engine_factory(), max_body_bytes=1 << 20) as server:
        for fields, param in cases:
            status, _, body = _request(server.url, "/v1/chat/completions", CHAT | fields)
            _assert_error(status, body, 400, param)
        beam = COMPLETION | {"use_beam_search": True, "n": 2, "guided_regex": "a+"}
        _assert_error(*_request(server.url, "/v1/completions", beam)[::2], 400, "structured_outputs")
        # text stays what it was: no constraint
        assert _request(server.url, "/v1/chat/completions", CHAT | {"response_format": {"type": "text"}})[0] == 200
        assert _engine_is_idle(server.engine)


def test_openai_client_json_schema_streamed_and_not_and_parse(openai_client):
    """The real SmolLM2 through the real client: whatever the model would say, the reply is the schema's JSON."""
    messages = [{"role": "user", "content": "What is the weather in Paris today? Reply in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model=MODEL, messages=messages, max_tokens=80, temperature=0, response_format=response_format)
    whole = openai_client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    streamed = "".join(  # a chunk may hold two entries for one choice: its role, then its first text
        choice.delta.content or ""
        for chunk in openai_client.chat.completions.create(stream=True, **kwargs)
        for choice in chunk.choices
    )
    assert streamed == text
    json_object = openai_client.chat.completions.create(
        **(kwargs | {"response_format": {"type": "json_object"}, "max_tokens": 120})
    )
    # any object: the 135M model may write one string until max_tokens; whatever it wrote is an object's start
    reply = json_object.choices[0]
    assert reply.message.content.startswith("{")
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)

    pydantic = pytest.importorskip("pydantic")

    class Weather(pydantic.BaseModel):
        city: str
        temperature_c: int

    parse = getattr(openai_client.chat.completions, "parse", None) or openai_client.beta.chat.completions.parse
    parsed = parse(model=MODEL, messages=messages, max_tokens=80, temperature=0, response_format=Weather)
    assert isinstance(parsed.choices[0].message.parsed, Weather)
