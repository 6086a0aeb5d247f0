"""Chat messages with tools, as the model's chat template takes them. A template that knows tools (it reads the
`tools` variable) gets them as HF's apply_chat_template passes them, and earlier calls' arguments as objects (the
templates write them with `tojson`). A template that knows none gets the tools in a system message that asks for
Hermes-style calls (`<tool_call>` JSON, what parsers.HermesParser reads), earlier calls written that way in the
assistant turns, and tool results as user turns."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from leanlm.tool_calls.call import Tool


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Does the conversation hold earlier calls or tool results (messages_for_template renders them, tools or not)?"""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def messages_for_template(
    messages: list[dict[str, Any]], tools: Sequence[Tool], template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(the messages to render, the `tools` template variable or None). `messages` are OpenAI-shaped dicts: an
    assistant turn may carry `tool_calls` (arguments as JSON text), a `tool` turn its `tool_call_id`."""
    if template_knows_tools(template):
        rendered = [_with_argument_objects(m) for m in messages]
        return rendered, [tool.to_openai() for tool in tools] or None
    rendered = [_as_plain_turn(m) for m in messages]
    if tools:
        instructions = _instructions(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{instructions}"}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered, None


def _instructions(tools: Sequence[Tool]) -> str:
    listing = "\n".join(json.dumps(tool.to_openai()["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to answer. Their signatures (JSON schema) are listed between <tools> and </tools>:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call one, reply with a JSON object naming it and giving its arguments, between <tool_call> and "
        "</tool_call>, one block per call:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            function["arguments"] = _arguments(function["arguments"])
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _as_plain_turn(message: dict[str, Any]) -> dict[str, Any]:
    """A turn a template without tools renders: calls as `<tool_call>` text, a tool's result as a user turn."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    blocks = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments")
        arguments = _arguments(arguments) if isinstance(arguments, str) else arguments
        body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    content = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {"role": message["role"], "content": content}


def _arguments(text: str) -> Any:
    """A call's arguments text as the object it encodes; refused when it is not a JSON object (the request names
    the call: the client sent it)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"a tool call's arguments must be a JSON object as text; got {text[:80]!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a tool call's arguments must be a JSON object, got {text[:80]!r}")
    return value
