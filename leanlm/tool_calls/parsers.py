"""How each model family writes tool calls into its reply, read back: Hermes / Qwen2.5 (`<tool_call>{json}</tool_call>`,
also what we prompt templates without tools to write), Llama 3.x (a JSON object with "parameters", after an optional
<|python_tag|>, several joined by ";") and Mistral (`[TOOL_CALLS]` then a JSON array). A reply whose call section does
not parse is returned whole as text, as vLLM's parsers do: a model that fumbles a call still answers."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from leanlm.tool_calls.call import ParsedReply, ToolCall


class ToolCallParser(ABC):
    """One family's call format. `find_start` / `hold_from` let a stream send text before a call section at once and
    hold back only what may turn out to be one."""

    name = ""
    marker = ""  # the text that opens a call section

    def find_start(self, text: str) -> int | None:
        """Where the call section of a (partial) reply begins, or None while none has."""
        start = text.find(self.marker)
        return None if start < 0 else start

    def hold_from(self, text: str) -> int:
        """The index from which a partial reply without a call section must be held back: a suffix that may be the
        start of the marker."""
        for size in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-size:]):
                return len(text) - size
        return len(text)

    def parse(self, text: str) -> ParsedReply:
        """A whole reply: its calls and the text around them; the reply as text when a call does not parse."""
        start = self.find_start(text)
        if start is None:
            return ParsedReply(text)
        calls = self.parse_section(text[start:])
        if calls is None:
            return ParsedReply(text)
        return ParsedReply(text[:start].strip(), tuple(calls))

    @abstractmethod
    def parse_section(self, section: str) -> list[ToolCall] | None:
        """The calls of a whole call section; None if it does not parse."""

    def closed_calls(self, section: str) -> list[ToolCall]:
        """The calls a partial section has already written whole (a stream sends each as it closes); families whose
        calls are only known at the end send them then."""
        return []

    @abstractmethod
    def call_grammar(self, call: str, parallel: bool) -> str:
        """The Lark rules (with `start`) of a reply that is only calls, each written by the rule `call` (a %json rule
        the caller appends): one call, or (parallel) one or more."""


class HermesParser(ToolCallParser):
    """Hermes 2 Pro / Qwen2.5 / SmolLM2: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call."""

    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"
    _call = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse_section(self, section: str) -> list[ToolCall] | None:
        calls = []
        for match in self._call.finditer(section):
            call = _call_from(_json(match.group(1)), "arguments")
            if call is None:
                return None
            calls.append(call)
        leftover = self._call.sub("", section).strip()
        return calls if calls and not leftover else None

    def closed_calls(self, section: str) -> list[ToolCall]:
        closed = section[: section.rfind(self.end) + len(self.end)] if self.end in section else ""
        return (self.parse_section(closed) or []) if closed else []

    def call_grammar(self, call: str, parallel: bool) -> str:
        one = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
        return f'start: tool_call ("\\n" tool_call)*\ntool_call: {one}' if parallel else f"start: {one}"


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1-3.3's JSON calls: `{"name": ..., "parameters": {...}}`, the reply's whole text (after an optional
    <|python_tag|>), several joined by "; "."""

    name = "llama3_json"
    marker = "<|python_tag|>"

    def find_start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", self.marker)) else None

    def hold_from(self, text: str) -> int:
        body = text.lstrip()  # a call section starts the reply: until its first character nothing can be sent
        return len(text) - len(body) if not body or self.marker.startswith(body) else len(text)

    def parse_section(self, section: str) -> list[ToolCall] | None:
        text = section.strip().removeprefix(self.marker).strip()
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(text):
            try:
                value, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = _call_from(value, "parameters")
            if call is None:
                return None
            calls.append(call)
            pos = _skip(text, pos, ";")
        return calls or None

    def call_grammar(self, call: str, parallel: bool) -> str:
        return f'start: {call} ("; " {call})*' if parallel else f"start: {call}"


class MistralParser(ToolCallParser):
    """Mistral's `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse_section(self, section: str) -> list[ToolCall] | None:
        value = _json(section.removeprefix(self.marker))
        if not isinstance(value, list):
            value = [value] if isinstance(value, dict) else None
        calls = [_call_from(v, "arguments") for v in value or ()]
        return calls if calls and all(c is not None for c in calls) else None

    def call_grammar(self, call: str, parallel: bool) -> str:
        more = f' (", " {call})*' if parallel else ""
        return f'start: "[TOOL_CALLS]" "[" {call}{more} "]"'


PARSERS: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def parser_for_template(template: str | None) -> ToolCallParser:
    """The family whose calls a chat template teaches: Mistral's or Llama 3's markers, else Hermes (also what a
    template without tools is prompted to write: tool_calls.prompt)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return PARSERS["mistral"]
    if "<tool_call>" not in text and ("<|python_tag|>" in text or "<|start_header_id|>" in text):
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _call_from(value: Any, arguments_key: str) -> ToolCall | None:
    """A call from its parsed JSON: {"name": str, arguments_key (or "arguments"): an object or its JSON text}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall.of(value["name"], arguments)


def _skip(text: str, pos: int, separator: str) -> int:
    """Past whitespace, one separator and whitespace again."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if text.startswith(separator, pos):
        pos += len(separator)
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
