"""OpenAI's tool-calling wire shapes: the tools a chat request offers, its tool_choice, and the calls an assistant
turn carries back in (their arguments are JSON text, as the API sends them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from leanlm.server.schema import Strict
from leanlm.tool_calls import Tool

MAX_TOOLS = 128  # as OpenAI's chat API
MAX_TOOL_NAME = 64


class FunctionDefinition(Strict):
    name: str = Field(max_length=MAX_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # its arguments' JSON schema
    strict: bool | None = None  # calls are always held to the schema when a call is required; accepted, not needed

    def tool(self) -> Tool:
        return Tool(self.name, self.description, self.parameters)


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str = Field(max_length=MAX_TOOL_NAME)


class NamedToolChoice(Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: the reply must call that function."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallMessage(Strict):
    """A call in an assistant turn the client sends back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
