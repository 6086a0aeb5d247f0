"""Mixtral, Qwen2-MoE and OLMoE against HF transformers' own classes on tiny random configs (float64), loaded from
the directory HF's save_pretrained writes and from the fused tensors a transformers-5 model holds in memory."""

import pytest
import torch

from leanlm.config import ModelConfig
from leanlm.formats.hf_dir import load_hf_dir, save_hf_dir
from leanlm.formats.moe_names import to_model_names
from leanlm.model.llama import build_model
from tests.model.test_llama import _paged_logits

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip

CASES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),  # fmt: skip
    ),
    "qwen2_moe_norm": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
        ),  # fmt: skip
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, clip_qkv=0.5)),
}


def hf_model(case: str):
    cls, cfg_cls, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**COMMON, **extra, experts_implementation="eager")  # grouped_mm: no float64
    hf = getattr(transformers, cls)(config).eval().double()
    for p in hf.parameters():  # HF zero-initialises routers; random ones make every routing decision count
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.5)
    return hf


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_saved_dir_matches_hf(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    config, state = load_hf_dir(tmp_path, dtype=torch.float64, progress=False)
    assert config.moe is not None and config.architecture == case.removesuffix("_norm")
    model = build_model(config, state, torch.float64)
    ids = torch.randint(0, 101, (23,), generator=torch.Generator().manual_seed(1))
    ours = _paged_logits(model, ids, [9, 1, 7, 6], list(range(16)))
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-5, rtol=0)
    used = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "stats") for c in layer.mlp.stats.load if c)
    assert used > 3  # the routers spread tokens over experts: the test exercises routing, not one expert


@pytest.mark.parametrize("case", ["mixtral", "olmoe"])
def test_fused_in_memory_tensors_load(case):
    hf = hf_model(case)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    state = to_model_names(config, dict(hf.state_dict()))
    model = build_model(config, state, torch.float64)
    ids = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_paged_logits(model, ids, [12], list(range(4))), hf_logits(hf, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_our_writer_round_trips_to_hf(case, tmp_path):
    """save_hf_dir writes what HF's from_pretrained reads as the same model."""
    hf = hf_model(case)
    config, state = load_hf_dir(_saved(hf, tmp_path / "hf"), dtype=torch.float64, progress=False)
    save_hf_dir(tmp_path / "ours", config, state)
    again = (
        getattr(transformers, CASES[case][0])
        .from_pretrained(tmp_path / "ours", dtype=torch.float64, experts_implementation="eager")
        .eval()
    )
    ids = torch.arange(10)
    torch.testing.assert_close(hf_logits(again, ids), hf_logits(hf, ids), atol=1e-10, rtol=0)


def _saved(hf, path):
    hf.save_pretrained(path)
    return path
