"""The bundled SmolLM2 (and, in the slow tier, Qwen2.5-Coder-0.5B: 14 heads in 2 KV groups, 24 layers) under
TP=2, PP=2 and TP=2 x PP=2 on local gloo processes, in float32: the one-process greedy tokens, logprobs within 1e-4."""

from __future__ import annotations

import pytest

from leanlm import LLM, SamplingParams
from tests.server.conftest import MODEL

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
LAYOUTS = [
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2),
    dict(tensor_parallel_size=2, pipeline_parallel_size=2),
]


def _run(model: str, **options):
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
    with LLM(model, dtype="float32", progress=False, **options) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]  # fmt: skip


def _assert_equal(model: str, layout: dict) -> None:
    for (want_ids, want_lp), (got_ids, got_lp) in zip(_run(model), _run(model, **layout)):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "pp2", "tp2xpp2"])
def test_smollm2_parallel_greedy_equals_one_process(layout):
    _assert_equal(MODEL, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=["tp2", "pp2"])
def test_qwen_05b_parallel_greedy_equals_one_process(layout):
    _assert_equal("qwen2.5-coder-0.5b-instruct", layout)


def test_a_2_4_sparse_smollm2_checkpoint_under_tp2_equals_one_process(tmp_path):
    """The bundled model pruned 2:4 (magnitude) and saved: its Sparse24 layers shard through their own unit."""
    import torch

    from leanlm.compress import MagnitudeConfig, compress
    from leanlm.formats.loader import load_checkpoint
    from leanlm.formats.native import save_checkpoint

    checkpoint = load_checkpoint(MODEL, "float32", progress=False, dequantize_gguf=True)
    compress(checkpoint.model, [MagnitudeConfig(pattern="2:4")], progress=False)
    save_checkpoint(checkpoint, tmp_path, dtype=torch.float32)
    assert '"sparse24"' in (tmp_path / "quantization_config.json").read_text()
    _assert_equal(str(tmp_path), dict(tensor_parallel_size=2))
