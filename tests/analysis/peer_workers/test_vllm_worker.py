"""The real vLLM worker, when its environment is set up (make peers-vllm): a short greedy run of vLLM's CPU
engine on the dense bf16 directory of the bundled model, fed our tokenizer's ids. Eager mode: the default
torch.compile warm-up would add about a minute to a test that checks the protocol, not the speed."""

from __future__ import annotations

import pytest

from leanlm.analysis.peer_process import VLLM, PeerBatch, PeerRequest, run_peer
from leanlm.loading.registry import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not VLLM.is_installed(), reason=VLLM.missing_message())


def test_vllm_worker_generates_exactly_and_sensibly(real_tokenizer):
    from leanlm.analysis.peer_models import ensure_dense_dir

    prompts = [real_tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4, 5, 6, 7,")]
    request = PeerRequest(
        ensure_dense_dir(DEFAULT_MODEL),
        tuple(map(tuple, prompts * 3)),
        output_len=6,
        batches=(PeerBatch(2, 2),),
        reps=2,
        kv_cache_gib=1,
        options={"engine_args": {"enforce_eager": True}, "prefix_caching": True},
        distinct_reps=True,  # the warm-up's prompts are the repetitions' again: they run from the prefix cache
    )
    run = run_peer(VLLM, request, timeout_s=600)
    assert run.info["peer"] == "vllm" and run.info["environment"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert run.info["engine_args_at_largest_cap"]["enable_prefix_caching"] is True
    outputs = [r.output_token_ids for r in run.repetitions]
    assert len(outputs) == 2 and all(len(t) == 6 for out in outputs for t in out)
    assert outputs[0] == outputs[1]
    assert "Paris" in real_tokenizer.decode(list(outputs[0][0]))
    assert real_tokenizer.decode(list(outputs[0][1])).strip().startswith("8")
    # vLLM computes in its engine core's model-worker process: counted as own, not as another process's CPU
    assert all(r.cpu.own_share > 0 for r in run.repetitions)
