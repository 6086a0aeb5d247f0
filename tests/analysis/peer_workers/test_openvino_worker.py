"""The real OpenVINO worker, when its environment is set up (make peers-openvino): a short greedy run through
LLMPipeline's continuous batching on the int4 IR of the bundled model, fed our tokenizer's ids."""

from __future__ import annotations

import pytest

from leanlm.analysis.peer_process import OPENVINO, PeerBatch, PeerRequest, run_peer
from leanlm.loading.registry import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not OPENVINO.is_installed(), reason=OPENVINO.missing_message())


def test_openvino_worker_generates_exactly_and_sensibly(real_tokenizer):
    from leanlm.analysis.peer_models import ensure_openvino_ir

    prompts = [real_tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4, 5, 6, 7,")]
    assert len(prompts[0]) != len(prompts[1])  # the padded batch and its attention mask are exercised
    request = PeerRequest(
        ensure_openvino_ir(DEFAULT_MODEL, "int4"),  # exported on first use (about 20 s)
        tuple(map(tuple, prompts * 3)),
        output_len=6,
        batches=(PeerBatch(2, 2), PeerBatch(1, 2)),
        reps=2,
        kv_cache_gib=1,
        options={"prefix_caching": True},
        distinct_reps=True,  # the warm-up's prompts are the repetitions' again: they run from the prefix cache
    )
    run = run_peer(OPENVINO, request, timeout_s=300)
    assert run.info["peer"] == "openvino" and run.info["versions"]["openvino_genai"] and run.info["prefix_caching"]
    outputs = [r.output_token_ids for r in run.repetitions]
    assert len(outputs) == 4 and all(len(t) == 6 for out in outputs for t in out)
    assert outputs[0] == outputs[1]  # greedy: repetitions agree
    assert "Paris" in real_tokenizer.decode(list(outputs[0][0]))
    assert real_tokenizer.decode(list(outputs[0][1])).strip().startswith("8")
    assert all(r.first_token_s is not None and 0 < r.first_token_s <= r.wall_s for r in run.repetitions)
