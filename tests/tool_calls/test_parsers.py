"""Each family's calls read back from replies, whole and streamed in pieces of every size; a call section that does
not parse comes back as text."""

from __future__ import annotations

import json

import pytest

from leanlm.tool_calls import PARSERS, ToolCallStreamer, parser_for_template

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "Europe/Paris"}

W, T = json.dumps(WEATHER), json.dumps(TIME)
REPLIES = {
    "hermes": (
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {T}}}\n</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
        "",
    ),
    "mistral": (
        f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
        "Sure.",
    ),
}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("family", list(REPLIES))
def test_whole_reply(family):
    text, content = REPLIES[family]
    parsed = PARSERS[family].parse(text)
    assert parsed.content == content
    assert _calls(parsed.tool_calls) == [("get_weather", WEATHER), ("get_time", TIME)]
    ids = [c.id for c in parsed.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("family", list(REPLIES))
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_reply_gives_the_same_calls_and_text(family, piece):
    text, content = REPLIES[family]
    streamer = ToolCallStreamer(PARSERS[family])
    sent_text, calls = "", []
    for i in range(0, len(text), piece):
        delta_text, delta_calls = streamer.feed(text[i : i + piece])
        sent_text += delta_text
        calls += delta_calls
    tail_text, tail_calls = streamer.finish()
    sent_text += tail_text
    calls += tail_calls
    assert sent_text.strip() == content
    assert _calls(calls) == [("get_weather", WEATHER), ("get_time", TIME)]


def test_hermes_stream_sends_each_call_when_it_closes_and_text_at_once():
    streamer = ToolCallStreamer(PARSERS["hermes"])
    assert streamer.feed("Hello <tool") == ("Hello ", [])  # "<tool" may open a call: held back
    assert streamer.feed('_call>\n{"name": "f", "arguments": {}}\n</tool_call>')[1][0].name == "f"
    assert streamer.feed("\n<tool_call>\n{") == ("", [])
    assert streamer.finish() == ("", [])  # an unfinished second call that does not parse: nothing more
    plain = ToolCallStreamer(PARSERS["hermes"])
    assert plain.feed("a <") == ("a ", [])
    assert plain.feed(" b") == ("< b", [])


@pytest.mark.parametrize(
    "family, text",
    [
        ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
        ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
        ("llama3_json", '{"name": "f", "parameters": {}} and then some text'),
        ("mistral", "[TOOL_CALLS] [{broken"),
    ],
)
def test_a_section_that_does_not_parse_is_text(family, text):
    parsed = PARSERS[family].parse(text)
    assert parsed.tool_calls == () and parsed.content == text
    streamer = ToolCallStreamer(PARSERS[family])
    sent = streamer.feed(text)[0] + streamer.finish()[0]
    assert sent == text


def test_arguments_given_as_json_text_are_read_too():
    parsed = PARSERS["hermes"].parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert _calls(parsed.tool_calls) == [("f", {"x": 1})]


def test_family_from_the_chat_template():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("<|start_header_id|>{{ tools }}<|python_tag|>").name == "llama3_json"
    assert parser_for_template("<|im_start|>{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert parser_for_template(None).name == "hermes"  # what a template without tools is prompted to write
