"""Structured output on the tiny random engine: every constrained output matches its format, greedy or sampled, alone or
batched with free requests; jump-forward saves forwards without changing greedy text; drafts stay valid; a format
that does not compile is refused before anything is allocated."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.engine import LLMEngine
from leanlm.engine.structured_output import StructuredOutput
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from leanlm.structured_outputs import StructuredOutputsParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colors": {"type": "array", "items": {"enum": ["red", "yellow", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
REGEX = r"(item|page|step)[0-9]{1,3}( (item|page|step)[0-9]{1,3}){2}"
TOOL_GRAMMAR = (
    'start: "<tool_call>" call "</tool_call>"\n'
    'call: %json {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, '
    '"arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, '
    '"required": ["city"], "additionalProperties": false}}, "required": ["name", "arguments"], '
    '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}'
)  # compact JSON: a random model would otherwise pick whitespace until max_tokens
PROMPT = "The quick brown fox"


def _constrained(spec: StructuredOutputsParams, **options) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 120, "structured_outputs": spec, **options})


def _text(engine: LLMEngine, params: SamplingParams, prompt: str = PROMPT) -> tuple[str, object]:
    engine.add_request(prompt, params, request_id="r")
    out = run_to_completion(engine)["r"].outputs[0]
    return out.text, out


@pytest.fixture
def engine(make_tiny_engine):
    return make_tiny_engine()


def test_json_schema_greedy_and_sampled_outputs_validate(make_tiny_engine):
    engine = make_tiny_engine()
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for i, params in enumerate(
        [_constrained(spec), SamplingParams(temperature=1.0, seed=3, max_tokens=120, structured_outputs=spec, n=4)]
    ):
        engine.add_request(PROMPT, params, request_id=str(i))
    final = run_to_completion(engine)
    outputs = [c for out in final.values() for c in out.outputs]
    assert len(outputs) == 5
    for c in outputs:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_regex_choice_and_tool_call_grammar(engine, temperature):
    cases = [
        (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
        (StructuredOutputsParams(choice=("red", "yellow", "blue")), lambda t: t in ("red", "yellow", "blue")),
        (StructuredOutputsParams(grammar=TOOL_GRAMMAR), _is_tool_call),
        (StructuredOutputsParams(grammar='root ::= "yes" | "no" " " [0-9]'), lambda t: re.fullmatch("yes|no [0-9]", t)),
    ]
    for spec, accepts in cases:
        params = SamplingParams(temperature=temperature, seed=7, max_tokens=120, structured_outputs=spec)
        text, out = _text(engine, params)
        assert out.finish_reason == "stop" and accepts(text), (spec.kind, text)


def _is_tool_call(text: str) -> bool:
    match = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.S)
    if match is None:
        return False
    call = json.loads(match.group(1))
    return call["name"] == "get_weather" and set(call["arguments"]) == {"city"}


def test_free_rows_batched_with_constrained_ones_get_their_tokens_alone(make_tiny_engine):
    free = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    ]
    alone = make_tiny_engine()
    for i, params in enumerate(free):
        alone.add_request(PROMPT, params, request_id=f"free{i}")
    expected = {k: v.outputs[0].token_ids for k, v in run_to_completion(alone).items()}
    mixed = make_tiny_engine()
    spec = StructuredOutputsParams(json=SCHEMA)
    for i, params in enumerate(free):
        mixed.add_request(PROMPT, params, request_id=f"free{i}")
        mixed.add_request(PROMPT, _constrained(spec, max_tokens=24), request_id=f"json{i}")
    got = {k: v.outputs[0].token_ids for k, v in run_to_completion(mixed).items() if k.startswith("free")}
    assert got == expected


def _count_forwards(engine: LLMEngine) -> list[int]:
    calls = []
    forward = engine.model_runner.step_forward

    def counting(plans):
        calls.append(1)
        return forward(plans)

    engine.model_runner.step_forward = counting
    return calls


def test_jump_forward_gives_the_same_greedy_text_in_fewer_forwards(make_tiny_engine):
    texts, forwards, token_ids = [], [], []
    for jump_forward in (False, True):
        engine = make_tiny_engine()
        engine.model_runner.structured_output.min_jump_forward_tokens = 1  # every forced run, however short
        calls = _count_forwards(engine)
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, jump_forward=jump_forward)
        text, out = _text(engine, _constrained(spec))
        texts.append(text)
        forwards.append(len(calls))
        token_ids.append(out.token_ids)
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[1]), SCHEMA)
    assert token_ids[0] == token_ids[1]  # forced tokens are llguidance's canonical ones: what greedy picks anyway here
    assert forwards[1] < forwards[0] * 0.8, forwards


def test_jump_forward_stops_at_max_tokens_and_reports_forced_logprobs(engine):
    engine.model_runner.structured_output.min_jump_forward_tokens = 1
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text, out = _text(engine, _constrained(spec, max_tokens=3, logprobs=2))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert text == '{"name":"'[: len(text)] or text.startswith('{"name":"')
    assert len(out.logprobs) == 3
    assert out.logprobs[1] == {out.token_ids[1]: 0.0}  # forced: no forward of its own


def test_short_forced_runs_are_decoded_as_usual(make_tiny_engine):
    """A forced run shorter than min_jump_forward_tokens is decoded token by token: the same text."""
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    texts = []
    for min_tokens in (1, 1000):
        engine = make_tiny_engine()
        engine.model_runner.structured_output.min_jump_forward_tokens = min_tokens
        texts.append(_text(engine, _constrained(spec))[0])
        assert (engine.model_runner.structured_output.num_forced_tokens > 0) == (min_tokens == 1)
    assert texts[0] == texts[1]


def test_stop_string_inside_forced_tokens_stops_there(engine):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text, out = _text(engine, _constrained(spec, stop=('"age"',)))
    assert out.finish_reason == "stop" and out.stop_reason == '"age"'
    assert '"age"' not in text and text.startswith('{"name":"')


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_drafts_keep_constrained_output_valid(make_tiny_engine, method):
    spec = StructuredOutputsParams(regex=r"(item1 page1 ){3,6}step[0-9]", jump_forward=False)
    plain = make_tiny_engine()
    expected, _ = _text(plain, _constrained(spec))
    engine = make_tiny_engine(speculative=method)
    text, out = _text(engine, _constrained(spec))
    assert re.fullmatch(r"(item1 page1 ){3,6}step[0-9]", text), text
    assert text == expected  # greedy verification under the mask equals masked greedy decoding
    assert engine.stats().spec_decode.num_draft_tokens > 0
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_trim_drafts_cuts_at_the_first_refused_token(tokenizer):
    from leanlm.engine.grammar import GrammarCompiler
    from leanlm.engine.request import Request

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,))
    request = Request("r", [1, 2], _constrained(StructuredOutputsParams(regex="ab[0-9]+")))
    request.grammar = compiler.matcher(request.sampling_params.structured_outputs)
    good = tokenizer.encode("ab1", add_special_tokens=False)
    drafts = [good + tokenizer.encode("x2", add_special_tokens=False)]
    StructuredOutput.trim_drafts([request], drafts)
    assert drafts == [good]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams(json={"type": "frobnicate"}), "does not compile"),
        (StructuredOutputsParams(regex="a(b"), "unclosed group"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "unknown name"),
        (StructuredOutputsParams(grammar="root ::= ("), "neither Lark nor valid GBNF"),
    ],
)
def test_a_format_that_does_not_compile_is_refused_before_allocation(engine, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request(PROMPT, _constrained(spec), request_id="bad")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="bad")  # the id was never taken
    run_to_completion(engine)


def test_compiled_grammars_are_cached_by_spec(engine):
    compiler = engine.grammar_compiler
    for jump_forward in (True, False, True):
        compiler.matcher(StructuredOutputsParams(json=SCHEMA, jump_forward=jump_forward))
    compiler.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA)))  # the same schema as text: the same entry
    assert compiler.num_cached == 1


def test_a_grammar_that_refuses_the_sampled_token_fails_its_request_alone(make_tiny_engine):
    engine = make_tiny_engine()
    spec = StructuredOutputsParams(choice=("red",))
    engine.add_request(PROMPT, _constrained(spec), request_id="bad")
    # a matcher in its error state refuses every token (what llguidance does past its limits, say)
    grammar = engine.scheduler.requests["bad"].grammar
    assert not grammar.consume_token(engine.tokenizer.encode("blue", add_special_tokens=False)[0])
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), request_id="ok")
    final = run_to_completion(engine)
    assert final["bad"].outputs[0].finish_reason == "error"
    assert "structured output" in final["bad"].outputs[0].error
    assert len(final["ok"].outputs[0].token_ids) == 8
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_structured_outputs_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="JSON schema"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="list of strings"):
        StructuredOutputsParams(choice="yes")
    spec = StructuredOutputsParams(json={"b": 1, "a": 2})  # key order kept: properties are generated in it
    assert spec.json == '{"b":1,"a":2}' and spec == StructuredOutputsParams(json='{"b": 1,  "a": 2}')
    assert hash(spec) == hash(StructuredOutputsParams(json='{"b": 1,  "a": 2}'))
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_masks_are_the_llguidance_bitmask_unpacked(tokenizer):
    """The [M, V] bool unpacking agrees with llguidance's own torch helper, for a vocabulary not a multiple of 32."""
    from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    from leanlm.engine.grammar import GrammarCompiler
    from leanlm.engine.request import Request

    vocab = tokenizer.vocab_size + 7
    compiler = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    request = Request("r", [1], _constrained(StructuredOutputsParams(regex="(item|page)[0-9]+")))
    request.grammar = compiler.matcher(request.sampling_params.structured_outputs)
    mask = StructuredOutput(vocab, None).start_masks([request], [[]]).result()
    reference = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(request.grammar, reference)
    logits = torch.zeros(1, vocab)
    apply_token_bitmask_inplace(logits, reference)
    assert torch.equal(mask.banned, logits.isinf())
    assert mask.rows.tolist() == [0]


def test_vocab_wider_than_the_tokenizer(tokenizer):
    config = tiny_config(tokenizer.vocab_size + 64)
    model = build_model(config, tiny_state_dict(config), torch.float64)
    engine = LLMEngine(model, tokenizer, EngineConfig(), torch.device("cpu"), torch.float64)
    text, out = _text(engine, _constrained(StructuredOutputsParams(regex=REGEX)))
    assert re.fullmatch(REGEX, text) and max(out.token_ids) < tokenizer.vocab_size


def test_llguidance_version_has_what_we_use():
    assert hasattr(llguidance.LLMatcher, "compute_ff_tokens") and hasattr(llguidance.LLMatcher, "validate_tokens")
