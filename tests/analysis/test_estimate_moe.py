"""MoE in `leanlm estimate`: parameter counts equal HF's own Mixtral / Qwen2-MoE / OLMoE, shapes come from MoE
config.json directories and GGUF files, active against total bytes, and the batch at which every expert is read."""

from __future__ import annotations

import json
import math

import pytest

from leanlm.analysis.estimate import (
    expected_experts_touched,
    expert_params,
    param_counts,
    streamed_weight_bytes,
    weight_format,
)
from leanlm.analysis.estimate_moe import batch_for_coverage, coverage_batches, moe_summary
from leanlm.analysis.model_shape import PRESETS, ModelShape, load_shape, shape_from_config
from leanlm.cli import main
from leanlm.config import ModelConfig

transformers = pytest.importorskip("transformers")

MIXTRAL = PRESETS["mixtral-8x7b"]
BF16 = weight_format("bf16")
MOE_CASES = ["mixtral", "qwen2_moe", "qwen2_moe_norm", "olmoe"]


@pytest.mark.parametrize("case", MOE_CASES)
def test_param_counts_equal_hf_models(case):
    """Every weight of HF's own module tree, counted: experts, shared expert and its gate, dense layers, q/k norms."""
    from tests.model.test_moe_hf import hf_model

    hf = hf_model(case)
    shape = shape_from_config(ModelConfig.from_hf_dict(hf.config.to_dict()))
    p = param_counts(shape)
    assert p.total == sum(t.numel() for t in hf.parameters())
    experts = sum(t.numel() for n, t in hf.named_parameters() if ".mlp.experts." in n)
    assert p.mlp - p.mlp_shared == experts
    unused = (shape.num_experts - shape.experts_per_token) * shape.moe_layers * expert_params(shape)
    assert p.active == p.total - unused


def test_qwen2_moe_shape_keeps_its_dense_layers_and_shared_expert():
    from tests.model.test_moe_hf import hf_model

    shape = shape_from_config(ModelConfig.from_hf_dict(hf_model("qwen2_moe").config.to_dict()))
    assert (shape.num_moe_layers, shape.dense_intermediate_size, shape.intermediate_size) == (2, 96, 32)
    assert shape.shared_expert_intermediate_size == 80 and shape.shared_expert_gate
    with pytest.raises(ValueError, match="dense_intermediate_size"):
        ModelShape("x", 10, 8, 8, 2, 2, 2, 4, num_experts=4, experts_per_token=2, num_moe_layers=1)


def _mixtral_8x7b_config() -> dict:
    """Mixtral-8x7B-v0.1's config.json (the fields that size it)."""
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "tie_word_embeddings": False}  # fmt: skip


def test_mixtral_config_dir_agrees_with_the_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_mixtral_8x7b_config()))
    shape, source = load_shape(tmp_path)
    assert source == str(tmp_path) and shape.num_experts == 8 and shape.experts_per_token == 2
    assert shape.max_context == MIXTRAL.max_context == 32768  # max_position_embeddings
    assert param_counts(shape) == param_counts(MIXTRAL)


def test_moe_gguf_file_gives_its_shape(tmp_path):
    from tests.formats.gguf.moe_gguf import write_moe_gguf
    from tests.model.test_moe_hf import hf_model

    hf = hf_model("qwen2_moe")
    write_moe_gguf(tmp_path / "q.gguf", hf)
    shape, _ = load_shape(tmp_path / "q.gguf")
    assert param_counts(shape).total == sum(t.numel() for t in hf.parameters())


def test_batch_at_which_every_expert_is_read():
    # Mixtral: 8 experts, top-2: E (1 - 0.75^B) >= 0.99 E from B = ceil(ln 0.01 / ln 0.75) = 17
    assert batch_for_coverage(MIXTRAL, 0.99) == 17 == math.ceil(math.log(0.01) / math.log(0.75))
    for shape in (MIXTRAL, ModelShape("x", 10, 8, 8, 1, 2, 2, 4, num_experts=64, experts_per_token=6)):
        for c in (0.5, 0.9, 0.99, 0.999):
            b = batch_for_coverage(shape, c)
            assert expected_experts_touched(shape, b) >= c * shape.num_experts
            assert b == 1 or expected_experts_touched(shape, b - 1) < c * shape.num_experts
    assert batch_for_coverage(PRESETS["llama-7b"]) == 1
    assert batch_for_coverage(ModelShape("x", 10, 8, 8, 1, 2, 2, 4, num_experts=4, experts_per_token=4)) == 1
    with pytest.raises(ValueError, match="0.99"):
        batch_for_coverage(MIXTRAL, 1.0)
    assert coverage_batches(17, 5) == [1, 2, 4, 5, 8, 16, 17, 32]


def test_active_bytes_per_token_is_attention_router_k_experts_and_one_embedding_row():
    s = MIXTRAL
    p = param_counts(s)
    by_hand = p.attention + 2 * s.num_hidden_layers * expert_params(s) + p.router + p.norms
    by_hand += s.hidden_size + s.vocab_size * s.hidden_size  # one embedding row, the head
    summary = moe_summary(s, BF16)
    assert summary.active_bytes_per_token == streamed_weight_bytes(s, BF16, 1) == 2 * by_hand
    assert summary.total_weight_bytes == 2 * p.total
    rows = {r.batch: r for r in summary.steps}
    assert rows[1].experts_per_layer == pytest.approx(2) and rows[17].experts_per_layer >= 7.92
    assert rows[32].weight_bytes == pytest.approx(2 * (p.total - (s.vocab_size - 32) * s.hidden_size), rel=1e-4)
    per_step = [r.weight_bytes for r in summary.steps]
    assert per_step == sorted(per_step) and summary.steps[-1].bytes_per_token < summary.steps[0].bytes_per_token / 8


def test_cli_estimate_reads_a_moe_config_dir(tmp_path, capsys):
    from tests.model.test_moe_hf import hf_model

    hf_model("olmoe").config.save_pretrained(tmp_path)
    assert main(["estimate", "--model", str(tmp_path), "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "MoE 8 experts top-2" in out and "every expert is read" in out and "bytes/token" in out
    assert main(["estimate", "--model", str(tmp_path), "--json", "--batch", "4"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["moe"]["all_experts_batch"] == batch_for_coverage(load_shape(tmp_path)[0])
    assert 4 in [row["batch"] for row in r["moe"]["steps"]]
    hf_model("qwen2_moe").config.save_pretrained(tmp_path / "qwen")
    assert main(["estimate", "--model", str(tmp_path / "qwen")]) == 0
    assert "top-3 + a shared expert of 80 in 2 layers (the others: FFN 96)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name,total,active",
    [("mixtral-8x7b", 46.7e9, 12.9e9), ("olmoe-1b-7b", 6.9e9, 1.3e9), ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9)],
)
def test_moe_presets_match_their_published_sizes(name, total, active):
    """The model cards' totals: Mixtral "47B, 13B active", OLMoE "6.9B, 1.3B active", Qwen1.5-MoE "14.3B, 2.7B"."""
    p = param_counts(PRESETS[name])
    assert p.total == pytest.approx(total, rel=5e-3) and p.active == pytest.approx(active, rel=2.5e-2)


def test_llama_config_with_a_leanlm_moe_block(tmp_path):
    """A MoE we build from a dense llama (MoEfication, upcycling) saves as llama + `leanlm_moe`; estimate reads it."""
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
           "leanlm_moe": {"num_experts": 8, "top_k": 2, "expert_intermediate_size": 32, "scoring": "ones",
                          "sparse_layers": [1, 2]}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape, _ = load_shape(tmp_path)
    assert (shape.num_experts, shape.experts_per_token, shape.intermediate_size) == (8, 2, 32)
    assert (shape.num_moe_layers, shape.dense_intermediate_size) == (2, 256)
    p = param_counts(shape)
    assert p.mlp == 2 * 8 * 3 * 64 * 32 + 2 * 3 * 64 * 256 and p.router == 2 * 64 * 8
    assert p.mlp_active == 2 * 2 * 3 * 64 * 32 + 2 * 3 * 64 * 256
