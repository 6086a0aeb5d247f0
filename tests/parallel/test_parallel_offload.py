"""max_weight_memory under TP and PP: each rank offloads its own slice's layers beyond the budget (a per-rank
budget), and the engine gives one process's greedy tokens and logprobs (the bundled SmolLM2 dequantized to float32: 30
layers)."""

from __future__ import annotations

import pytest

from leanlm import LLM, SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
# per rank: a TP rank holds half the embedding (57 MB) and 30 half layers (7 MB each), a stage the embedding or the
# tied head (113 MB) and 15 layers (14 MB each): 160 MB holds some of each rank's layers, not all
BUDGET = 160 * 10**6


def _run(**options):
    from tests.server.conftest import MODEL

    with LLM(MODEL, dtype="float32", dequantize_gguf=True, progress=False, **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        streamed = None if llm.offloaded is None else llm.offloaded.plan.streamed_idx
    results = [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]  # fmt: skip
    return results, streamed


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_each_rank_offloads_its_slice_and_tokens_equal_one_process(layout):
    want, _ = _run()
    got, streamed = _run(max_weight_memory=BUDGET, **layout)
    assert streamed, "rank 0 kept every layer of its slice resident: the budget did not bind"
    for (want_ids, want_lp), (got_ids, got_lp) in zip(want, got):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
