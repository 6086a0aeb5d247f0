"""Messages with tools, as a chat template takes them: a template that reads `tools` gets them (and earlier calls'
arguments as objects, for its `tojson`); one that does not gets them in a system turn asking for `<tool_call>` JSON."""

from __future__ import annotations

import json

import pytest

from leanlm.loading.chat_template import render_chat_template
from leanlm.tool_calls import PARSERS, Tool, messages_for_template

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
WITH_TOOLS = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}\n"
    "{% endfor %}"
)
TOOL = Tool("get_weather", "Weather now", {"type": "object", "properties": {"city": {"type": "string"}}})
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_1"},
]


def test_a_template_with_tools_gets_them_and_argument_objects():
    messages, tools = messages_for_template(MESSAGES, [TOOL], WITH_TOOLS)
    text = render_chat_template(WITH_TOOLS, messages, False, tools=tools)
    assert text.startswith("TOOLS:get_weather;user: Weather in Oslo?")
    assert 'CALL get_weather {"city": "Oslo"}' in text
    assert MESSAGES[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the caller's dicts untouched


def test_a_template_without_tools_is_told_to_write_hermes_calls():
    messages, tools = messages_for_template([{"role": "system", "content": "Be brief."}, *MESSAGES], [TOOL], CHATML)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    text = render_chat_template(CHATML, messages, False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert json.dumps(TOOL.to_openai()["function"]) in text
    assert '<tool_response>\n{"temp": -3}\n</tool_response>' in text
    earlier = PARSERS["hermes"].parse(messages[2]["content"])  # the earlier call, written as the parser reads it
    assert [(c.name, json.loads(c.arguments)) for c in earlier.tool_calls] == [("get_weather", {"city": "Oslo"})]


def test_call_arguments_that_are_not_a_json_object_are_refused():
    bad = {**CALL, "function": {"name": "get_weather", "arguments": "city=Oslo"}}
    with pytest.raises(ValueError, match="JSON object"):
        messages_for_template([{"role": "assistant", "content": None, "tool_calls": [bad]}], [TOOL], WITH_TOOLS)
