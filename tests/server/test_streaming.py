"""streaming.ChunkEncoder: each delta chunk's event equals the one encoding the whole chunk would give."""

from __future__ import annotations

import json

import pytest

from leanlm.server import responses
from leanlm.server.streaming import ChunkEncoder, _sse

CHOICES = [
    [{"index": 0, "text": ' "quoted" \\ caf\u00e9 \u2603\n', "logprobs": None, "finish_reason": None}],
    [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
    [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}, {"index": 3}],
]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("choices", CHOICES)
def test_chunk_encoder_matches_encoding_the_whole_chunk(choices, include_usage):
    envelope = responses.envelope('cmpl-"x"\u00e9', "text_completion", "mod\\el \u2603", 1700000000)
    chunk = {**envelope, "choices": choices}
    if include_usage:
        chunk["usage"] = None
    event = ChunkEncoder(envelope, include_usage)(choices)
    assert event == _sse(chunk)
    assert json.loads(event.removeprefix("data: ")) == chunk


def test_chunk_encoder_refuses_an_empty_envelope():
    with pytest.raises(ValueError, match="non-empty JSON object"):
        ChunkEncoder({}, include_usage=False)
