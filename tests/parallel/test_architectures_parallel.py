"""The new architectures' blocks under tensor and pipeline parallelism give the one-process engine's greedy tokens
and logprobs (float32): Qwen3's per-head q/k norms (and Qwen3-MoE's experts), Phi-3's split projections with a
partial rotary and Gemma 3's local rope and windows with heads split unevenly
over 2 ranks, Gemma 2's soft-capped attention and logits over 2 stages, DeepSeek's latent attention and routing over
2 ranks (V3) and 2 stages (V2)."""

from __future__ import annotations

import pytest
import torch

from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.hf_dir import load_hf_dir
from leanlm.formats.native import save_checkpoint
from leanlm.model.llama import build_model
from tests.conftest import hf_tiny
from tests.parallel.test_parallel_engine import _assert_same, _run

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
              head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
# MLA's 6 heads split 3 + 3 (each rank caches the whole latent), 4 experts of 32 after a dense first layer
_DEEPSEEK = dict(num_key_value_heads=6, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1)  # fmt: skip
CASES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}, dict(tensor_parallel_size=2)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
        dict(tensor_parallel_size=2),
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            head_dim=16,
            pad_token_id=0,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75),
        ),
        dict(tensor_parallel_size=2),
    ),  # fmt: skip
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        dict(tensor_parallel_size=2),
    ),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(_DEEPSEEK, q_lora_rank=48, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
        dict(tensor_parallel_size=2),
    ),
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(_DEEPSEEK, q_lora_rank=None, topk_method="greedy"),
        dict(pipeline_parallel_size=2),
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        dict(pipeline_parallel_size=2),
    ),
}


def _checkpoint(case: str, root, tokenizer) -> str:
    cls, cfg_cls, extra, _ = CASES[case]
    hf = hf_tiny(cls, cfg_cls, vocab_size=tokenizer.vocab_size, **(COMMON | extra))  # a case's own values win
    hf.save_pretrained(root / "hf")
    config, state = load_hf_dir(root / "hf", dtype=torch.float32, progress=False)
    save_checkpoint(
        Checkpoint(build_model(config, state, torch.float32), tokenizer), root / "ours", dtype=torch.float32
    )
    return str(root / "ours")


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_engine_equals_one_process(case, tmp_path):
    from tests.tiny_tokenizer import tiny_tokenizer

    path = _checkpoint(case, tmp_path, tiny_tokenizer())
    _assert_same(_run(path, **CASES[case][3]), _run(path))
