"""The grammar of a reply that must be tool calls (tool_choice "required" or a named function): the family's call
syntax around JSON that llguidance holds to each function's parameter schema, so every call parses and validates."""

from __future__ import annotations

import json
from collections.abc import Sequence

from leanlm.tool_calls.call import Tool
from leanlm.tool_calls.parsers import ToolCallParser


def required_call_grammar(parser: ToolCallParser, tools: Sequence[Tool], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with a %json rule): one call to one of `tools` (or, parallel, one or more calls),
    written as `parser`'s family writes them. Pass one tool to force that function."""
    if not tools:
        raise ValueError("a required tool call needs at least one tool")
    key = "parameters" if parser.name == "llama3_json" else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, key: tool.schema},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return f"{parser.call_grammar('call_json', parallel)}\ncall_json: %json {json.dumps(schema)}\n"
