"""StructuredOutputsParams: the format one request's output must follow (vLLM's name and fields). The engine
compiles it with llguidance (engine/grammar.py) and masks every sampled token to it (engine/structured_output.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The kinds of spec, each a field below; exactly one is set.
SPEC_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of json / json_object / regex / choice / grammar. Validated for shape here; whether the schema,
    regex or grammar compiles is checked by the engine when the request is added (a ValueError naming the error)."""

    # A JSON schema, as a dict or its JSON text; stored as compact JSON text (key order kept: it is the order the
    # properties are generated in) so that equal schemas share one compiled grammar and the params stay hashable.
    json: str | dict[str, Any] | None = None
    json_object: bool = False  # any JSON object ({"type": "object"})
    regex: str | None = None  # the whole output matches this regex (Rust regex syntax, anchored at both ends)
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    # A Lark grammar as llguidance takes it (`%json {...}` embeds a JSON schema), or a llama.cpp GBNF grammar
    # (recognized by its `::=` rules and converted to Lark).
    grammar: str | None = None
    # JSON without whitespace between tokens (compact output, fewer tokens); otherwise any whitespace is allowed.
    disable_any_whitespace: bool = False
    # Jump-forward decoding: where the format allows exactly one continuation, append its tokens without a forward
    # each. Off only to measure what it saves (the output is the same).
    jump_forward: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _canonical_json(self.json))
        elif isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs json must be a JSON schema (an object): {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs json must be a JSON schema object, got {type(schema).__name__}")
            object.__setattr__(self, "json", _canonical_json(schema))
        elif self.json is not None:
            raise ValueError(f"structured_outputs json must be a dict or its JSON text, got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs choice must be a list of strings, e.g. ['yes', 'no']")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(self.choice):
                raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        for name in ("json_object", "disable_any_whitespace", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs {name} must be true or false, got {getattr(self, name)!r}")
        given = [name for name in SPEC_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(SPEC_FIELDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )

    @property
    def kind(self) -> str:
        """Which spec field is set ('json', 'json_object', 'regex', 'choice' or 'grammar')."""
        return next(name for name in SPEC_FIELDS if getattr(self, name) not in (None, False))

    @property
    def num_spec_chars(self) -> int:
        """Characters of the spec (the server bounds it)."""
        value = getattr(self, self.kind)
        if isinstance(value, bool):
            return 0
        return sum(map(len, value)) if isinstance(value, tuple) else len(value)


def _canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs json must be JSON-serializable: {exc}") from None
