"""Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3 (LongRoPE; partial rotary as Phi-4-mini) and DeepSeek-V2/V3 GGUF files
(written as llama.cpp's converter writes them: tests/formats/gguf/arch_gguf.py) load with HF transformers' logits (HF
in float32: its grouped expert GEMM takes no float64; within 1e-4), and as an LLM."""

import dataclasses

import pytest
import torch

from leanlm import LLM, SamplingParams
from leanlm.formats.gguf import load_gguf
from leanlm.model.llama import build_model
from tests.conftest import hf_tiny
from tests.formats.gguf.arch_gguf import write_arch_gguf
from tests.model.test_llama import _paged_logits

transformers = pytest.importorskip("transformers")

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
# what llama.cpp's graphs fix in code, the HF configs say the same: Gemma's attention scale from head_dim, Gemma 2's
# every-other and Gemma 3's five-to-one window patterns, Gemma 3's local rope base 10000
# llama.cpp's deepseek2 (V2 and V3 alike): MLA with a latent of 32 for 4 heads, 8 experts after a dense first layer
_DEEPSEEK = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, tie_word_embeddings=False, head_dim=8)  # fmt: skip
CASES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_hidden_layers=3, tie_word_embeddings=False)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            original_max_position_embeddings=64,
            pad_token_id=0,
            head_dim=16,
            rope_parameters=dict(
                rope_type="longrope",
                short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.5 * i for i in range(8)],
                original_max_position_embeddings=64,
                rope_theta=10000.0,
                partial_rotary_factor=1.0,
            ),
        ),
    ),  # fmt: skip
    "phi4-mini-like": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            num_hidden_layers=3,
            pad_token_id=0,
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75),
        ),
    ),  # fmt: skip
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(_DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    "deepseek_v2-yarn": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(
            _DEEPSEEK,
            q_lora_rank=None,
            topk_method="greedy",
            routed_scaling_factor=1.5,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=0.707,
                mscale_all_dim=0.707,
                rope_theta=10000.0,
            ),
        ),
    ),  # fmt: skip
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            num_hidden_layers=3,
            query_pre_attn_scalar=32,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),  # fmt: skip
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            query_pre_attn_scalar=32,
            sliding_window=6,
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
        ),
    ),  # fmt: skip
}
IDS = torch.randint(3, VOCAB, (19,), generator=torch.Generator().manual_seed(3))


def _hf(case: str):
    cls, cfg_cls, extra = CASES[case]
    return hf_tiny(cls, cfg_cls, **(COMMON | extra))


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_hf(case, tmp_path):
    hf = _hf(case)
    want = write_arch_gguf(tmp_path / f"{case}.gguf", hf)
    config, state, _ = load_gguf(tmp_path / f"{case}.gguf", dtype=torch.float64, progress=False)
    untrained = [
        None if m is None else dataclasses.replace(m, router_aux_loss_coef=0.0) for m in (config.moe, want.moe)
    ]
    assert untrained[0] == untrained[1]  # a training-only coefficient is no GGUF metadata
    assert (config.architecture, config.layer_windows) == (want.architecture, want.layer_windows)
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0].double()
    got = _paged_logits(build_model(config, state, torch.float64), IDS, [8, 1, 6, 4], list(range(16)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_llm_serves_a_gemma3_gguf_like_hf_greedy(tmp_path):
    hf = _hf("gemma3")
    write_arch_gguf(tmp_path / "g.gguf", hf)
    prompt = IDS.tolist()
    with LLM(str(tmp_path / "g.gguf"), dtype="float32", progress=False) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
    assert list(out[0].outputs[0].token_ids) == ref.tolist()
