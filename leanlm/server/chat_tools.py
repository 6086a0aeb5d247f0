"""What a chat request's tools change: the turns and `tools` variable its template renders, the family whose calls
the reply is read for, and the grammar a required call is held to; then the reply as OpenAI's assistant message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leanlm.server.protocol import ChatCompletionRequest, InvalidParameterError
from leanlm.tool_calls import (
    PARSERS,
    Tool,
    ToolCallParser,
    has_tool_turns,
    messages_for_template,
    parser_for_template,
    required_call_grammar,
)
from leanlm.tool_calls.prompt import template_knows_tools


@dataclass(frozen=True)
class ChatTools:
    messages: list[dict[str, Any]]  # the turns to render
    template_tools: list[dict[str, Any]] | None  # the template's `tools` variable (None: none, or it knows none)
    parser: ToolCallParser | None  # the family whose calls the reply is read for; None: the reply is text
    grammar: str | None  # a required call's grammar (llguidance Lark); None: the reply is free


def prepare_tools(request: ChatCompletionRequest, template: str | None, parser_name: str | None) -> ChatTools:
    """`parser_name` is the server's --tool-call-parser (None: the family the template teaches)."""
    tools = tool_list(request)
    required = required_tools(request, tools)
    messages = request.chat_messages()
    if not tools and not has_tool_turns(messages):
        return ChatTools(messages, None, None, None)
    messages, template_tools = messages_for_template(messages, tools, template)
    knows_tools = template_knows_tools(template)
    parser = PARSERS[parser_name] if parser_name else parser_for_template(template if knows_tools else None)
    grammar = required_call_grammar(parser, required, request.parallel_tool_calls) if required else None
    reads_calls = bool(tools) and request.tool_choice != "none"
    return ChatTools(messages, template_tools, parser if reads_calls else None, grammar)


def tool_list(request: ChatCompletionRequest) -> list[Tool]:
    """The offered tools (checked: OpenAI's name rule, one of each name)."""
    tools = [t.function.tool() for t in request.tools or ()]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameterError("tools", f"tool names must be unique, got {names}")
    return tools


def required_tools(request: ChatCompletionRequest, tools: list[Tool]) -> list[Tool] | None:
    """The tools one of which the reply must call (tool_choice "required": any; a named function: that one); None
    when the reply may answer in text."""
    choice = request.tool_choice
    if choice in (None, "none", "auto"):
        return None
    if not tools:
        raise InvalidParameterError("tool_choice", "tool_choice asks for a tool call, but the request has no tools")
    if choice == "required":
        return tools
    named = [t for t in tools if t.name == choice.function.name]
    if not named:
        raise InvalidParameterError(
            "tool_choice", f"tool_choice names {choice.function.name!r}, which is not one of the request's tools"
        )
    return named


def assistant_message(text: str, parser: ToolCallParser | None) -> tuple[dict[str, Any], bool]:
    """(OpenAI's assistant message for a whole reply, whether it calls tools)."""
    if parser is None:
        return {"role": "assistant", "content": text}, False
    parsed = parser.parse(text)
    if not parsed.tool_calls:
        return {"role": "assistant", "content": text}, False
    message = {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [call.to_openai() for call in parsed.tool_calls],
    }
    return message, True
