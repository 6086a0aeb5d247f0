"""Outputs by kind: DELTA outputs are increments that add up to the CUMULATIVE result (text, token ids,
logprobs, prompt logprobs once), through stop strings and n > 1; FINAL_ONLY gives one output; the text kept in
pieces reads and cuts like a string."""

from __future__ import annotations

import dataclasses

import pytest

from leanlm.engine.output_processor import _CompletionState
from leanlm.sampling_params import RequestOutputKind, SamplingParams

PROMPT_TEXT = "Once upon a time"


def _run(engine, prompt, params):
    """Every output of one request, in order."""
    rid = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == rid)
    return outputs


def _params(**kw):
    base = dict(n=2, temperature=1.0, seed=5, max_tokens=30, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return SamplingParams(**{**base, **kw})


@pytest.fixture
def stop(make_tiny_engine, tokenizer):
    """Three characters from the middle of completion 0's text: a stop string that ends it early."""
    final = _run(make_tiny_engine(), tokenizer.encode(PROMPT_TEXT), _params())[-1].outputs[0].text
    middle = len(final) // 2
    return final[middle : middle + 3]


def test_deltas_add_up_to_the_cumulative_result(make_tiny_engine, tokenizer, stop):
    prompt = tokenizer.encode(PROMPT_TEXT)
    whole = _run(make_tiny_engine(), prompt, _params(stop=[stop]))
    deltas = _run(make_tiny_engine(), prompt, _params(stop=[stop], output_kind=RequestOutputKind.DELTA))
    final = whole[-1]
    assert any(c.finish_reason == "stop" for c in final.outputs)
    assert all(o.kind == RequestOutputKind.DELTA for o in deltas) and deltas[-1].finished
    for c in final.outputs:
        parts = [o.outputs[c.index] for o in deltas]
        assert "".join(p.text for p in parts) == c.text
        assert [t for p in parts for t in p.token_ids] == c.token_ids  # each token exactly once
        assert [lp for p in parts for lp in p.logprobs] == c.logprobs
        assert parts[-1].finish_reason == c.finish_reason and parts[-1].stop_reason == c.stop_reason
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in deltas[1:])
    assert len(deltas) > 5  # a real stream of increments, not one output


def test_final_only_is_one_whole_output(make_tiny_engine, tokenizer, stop):
    prompt = tokenizer.encode(PROMPT_TEXT)
    whole = _run(make_tiny_engine(), prompt, _params(stop=[stop]))[-1]
    (only,) = _run(make_tiny_engine(), prompt, _params(stop=[stop], output_kind=RequestOutputKind.FINAL_ONLY))
    assert only.finished and only.outputs == whole.outputs
    assert dataclasses.replace(only, metrics=None) == dataclasses.replace(whole, metrics=None)


def test_the_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_text_in_pieces_reads_and_cuts_as_one_string():
    state = _CompletionState(request=None, index=0, detokenizer=None)
    for piece in ("Hel", "", "lo, w", "o", "rld!"):
        state.append(piece)
    text = "Hello, world!"
    assert state.num_chars == len(text) and state.text_parts == ["Hel", "lo, w", "o", "rld!"]
    assert [state.tail(i) for i in range(-1, 15)] == [text] + [text[i:] for i in range(15)]
    state.truncate(7)
    assert state.text == "Hello, " and state.num_chars == 7 and state.tail(5) == ", "
    state.truncate(0)
    assert state.text == "" and state.num_chars == 0
