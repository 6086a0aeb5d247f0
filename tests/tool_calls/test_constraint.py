"""The grammar of a required call, compiled by llguidance over a real tokenizer: it accepts each family's calls whose
arguments fit the function's schema (and the parser reads them back), and refuses other names, arguments that break
the schema, and a second call unless calls may run in parallel."""

from __future__ import annotations

import json

import llguidance
import pytest

from leanlm.tool_calls import PARSERS, Tool, required_call_grammar

WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
TIME = Tool("get_time", None, None)  # no parameters: any object
KEY = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}


def _write(family: str, calls: list[tuple[str, dict]]) -> str:
    objs = [json.dumps({"name": n, KEY[family]: a}) for n, a in calls]
    if family == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if family == "llama3_json":
        return "; ".join(objs)
    return "[TOOL_CALLS][" + ", ".join(objs) + "]"


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_token_id)


def _accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("family", list(KEY))
def test_required_call_grammar(family, ll_tokenizer, tokenizer):
    parser = PARSERS[family]
    one = required_call_grammar(parser, [WEATHER, TIME], parallel=False)
    many = required_call_grammar(parser, [WEATHER, TIME], parallel=True)
    good = [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert _accepts(ll_tokenizer, tokenizer, one, _write(family, good))
    parsed = parser.parse(_write(family, good))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == good
    two = good + [("get_time", {"zone": "UTC"})]
    assert not _accepts(ll_tokenizer, tokenizer, one, _write(family, two))
    assert _accepts(ll_tokenizer, tokenizer, many, _write(family, two))
    for bad in (
        [("get_stock", {"city": "Paris"})],  # no such function
        [("get_weather", {"unit": "celsius"})],  # a required argument missing
        [("get_weather", {"city": "Paris", "unit": "kelvin"})],  # outside the enum
        [("get_weather", {"city": "Paris", "when": "now"})],  # an argument the schema forbids
    ):
        assert not _accepts(ll_tokenizer, tokenizer, many, _write(family, bad)), bad


def test_a_named_function_is_the_only_one_allowed(ll_tokenizer, tokenizer):
    grammar = required_call_grammar(PARSERS["hermes"], [TIME], parallel=True)
    assert _accepts(ll_tokenizer, tokenizer, grammar, _write("hermes", [("get_time", {})]))
    assert not _accepts(ll_tokenizer, tokenizer, grammar, _write("hermes", [("get_weather", {"city": "x"})]))


def test_tools_are_checked():
    with pytest.raises(ValueError, match="1-64 letters"):
        Tool("get weather")
    with pytest.raises(ValueError, match="JSON schema object"):
        Tool("f", None, ["not", "a", "schema"])
    with pytest.raises(ValueError, match="at least one tool"):
        required_call_grammar(PARSERS["hermes"], [], parallel=True)
