"""A tool a request offers (OpenAI's function tool) and a call parsed out of a reply."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

# OpenAI's rule for function names: letters, digits, underscores and dashes, at most 64.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# The arguments schema of a function declared without parameters: any object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    """One function the model may call. `parameters` is its arguments' JSON schema (an object schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: the function takes any object

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"tool name {self.name!r} must be 1-64 letters, digits, underscores or dashes (OpenAI's rule)"
            )
        if self.parameters is not None and not isinstance(self.parameters, dict):
            raise ValueError(f"the parameters of tool {self.name!r} must be a JSON schema object")

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else ANY_OBJECT

    def to_openai(self) -> dict[str, Any]:
        """The {"type": "function", "function": {...}} entry chat templates receive as `tools` (HF's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text (OpenAI's wire shape)."""

    id: str  # "call_..." unique per call
    name: str
    arguments: str  # a JSON object, as text

    @classmethod
    def of(cls, name: str, arguments: Any) -> ToolCall:
        """From a parsed call: arguments as a dict (serialized) or already as JSON text."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(new_call_id(), name, text)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text and its tool calls."""

    content: str  # the text outside the calls ("" when there is none)
    tool_calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
