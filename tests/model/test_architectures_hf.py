"""Every architecture against HF transformers itself: a tiny random checkpoint HF writes (`from_config(...)
.save_pretrained`), loaded from that directory; prompt logprobs within 1e-4 in float32 through the paged, chunked
forward; greedy tokens equal to HF's generate; a batch equal to each request alone. The configs vary what real
checkpoints vary: tied and untied heads, head_dim not hidden / heads, GQA ratios, sliding patterns, rope scaling."""

import dataclasses

import pytest
import torch

from leanlm.analysis.estimate import param_counts
from leanlm.analysis.model_shape import load_shape
from leanlm.config import EngineConfig, ModelConfig
from leanlm.config.architectures import SUPPORTED_ARCHITECTURES
from leanlm.engine import LLMEngine
from leanlm.formats.hf_dir import load_hf_dir, save_hf_dir
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import hf_tiny, run_to_completion
from tests.model.test_llama import _paged_logits

transformers = pytest.importorskip("transformers")

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
_LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0 + 0.1 * i for i in range(8)],
    long_factor=[2.0 + 0.5 * i for i in range(8)],
    original_max_position_embeddings=64,
)
# MLA with a latent of 32 (+ a shared rotary key of 8) for 4 heads of q/k 16 + 8 and v 16; 8 experts of 32 after a
# dense first layer, 2 per token, and a shared expert
_DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, tie_word_embeddings=False)  # fmt: skip
# case -> (HF class, HF config class, config kwargs)
CASES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "qwen3-tied-linear-rope": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(
            num_key_value_heads=1,
            head_dim=24,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=5000.0),
        ),
    ),  # fmt: skip
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=100.0),
            },
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(_LONGROPE, rope_theta=10000.0, partial_rotary_factor=1.0),
            original_max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(_DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    "deepseek_v3-yarn": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            _DEEPSEEK,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            rope_interleave=False,
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
    "deepseek_v2": (
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        dict(
            _DEEPSEEK,
            q_lora_rank=40,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        ),
    ),  # fmt: skip
    "phi3-partial-rotary": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            num_key_value_heads=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
}


def _hf_model(case: str):
    cls, cfg_cls, extra = CASES[case]
    return hf_tiny(cls, cfg_cls, **COMMON, **extra)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (HF model, our float32 model loaded from the directory HF wrote, that directory)."""
    out = {}
    for case in CASES:
        hf = _hf_model(case)
        path = tmp_path_factory.mktemp(case)
        hf.save_pretrained(path)
        config, state = load_hf_dir(path, dtype=torch.float32, progress=False)
        out[case] = (hf, build_model(config, state, torch.float32), path)
    return out


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_match_hf(saved, case):
    hf, ours, _ = saved[case]
    ids = _prompt(20)  # past the sliding windows (6) and, for longrope, nothing past its original context
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[None]).logits[0].double(), -1)
    # a prompt in uneven chunks over scattered blocks, then single-token decodes
    got = torch.log_softmax(_paged_logits(ours, ids, [7, 5, 4, 1, 1, 1, 1], list(range(12))).double(), -1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_every_supported_architecture_has_a_case():
    covered = {CASES[c][2].get("model_type") or _hf_model(c).config.model_type for c in CASES}
    plain = {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "olmoe"}  # tests/model/test_llama.py, test_moe_hf.py
    assert set(SUPPORTED_ARCHITECTURES) <= covered | plain


def _engine(model, tokenizer) -> LLMEngine:
    config = EngineConfig.from_options(block_size=4, max_num_batched_tokens=16)
    return LLMEngine(model, tokenizer, config, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("case", ["qwen3_moe", "gemma2", "gemma3", "phi3", "deepseek_v3", "deepseek_v2"])
def test_greedy_tokens_match_hf_and_a_batch_matches_each_alone(saved, case, tokenizer):
    hf, ours, _ = saved[case]
    prompts = [_prompt(n, seed).tolist() for n, seed in ((11, 3), (5, 4), (17, 5))]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    engine = _engine(ours, tokenizer)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))
    batched = {k: list(v.outputs[0].token_ids) for k, v in run_to_completion(engine).items()}
    for i, p in enumerate(prompts):
        alone = _engine(ours, tokenizer)
        alone.add_request(p, params, "x")
        assert list(run_to_completion(alone)["x"].outputs[0].token_ids) == batched[str(i)]
        hf.generation_config.eos_token_id = None  # as ignore_eos: HF would stop at token 2
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)
        assert batched[str(i)] == ref[0, len(p) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_saved_directory_is_hfs_own(saved, case, tmp_path):
    """What we save, HF loads as its own class with the same logits (Phi-3's projections fused again)."""
    hf, ours, _ = saved[case]
    state = {
        k: v for k, v in ours.state_dict().items() if not (ours.config.tie_word_embeddings and k == "lm_head.weight")
    }
    save_hf_dir(tmp_path, ours.config, state)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(again) is type(hf)
    ids = _prompt(12)
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None]).logits, hf(ids[None]).logits, atol=1e-5, rtol=0)
    assert dataclasses.replace(ModelConfig.from_hf_dict(again.config.to_dict()), name="") == ours.config


def test_an_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2.*gemma3_text.*phi3"):
        ModelConfig.from_hf_dict({"model_type": "falcon", "hidden_size": 8})


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_counts_hfs_parameters_from_config_json_alone(saved, case):
    hf, _, path = saved[case]
    shape, _ = load_shape(path)
    assert param_counts(shape).total == sum(p.numel() for p in hf.parameters())
