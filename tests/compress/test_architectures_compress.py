"""The compression loop on the new blocks, through their declared linear groups: smoothing that only moves scales
leaves Gemma's (+1) norms' function exact, and GPTQ, AWQ, SmoothQuant, SparseGPT and Wanda run on Qwen3 and Gemma 3
layers (per-head q/k norms, sandwich norms, GELU gates) with the error each method should have."""

import pytest
import torch

from leanlm.compress import (
    AWQConfig,
    GPTQConfig,
    MagnitudeConfig,
    RTNConfig,
    SmoothQuantConfig,
    SparseGPTConfig,
    WandaConfig,
    compress,
)
from leanlm.formats.hf_dir import load_hf_dir
from leanlm.model.llama import build_model
from leanlm.model.quantized.numerics import sqnr_db
from tests.compress.conftest import dense_logits
from tests.conftest import hf_tiny

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=128)  # fmt: skip
CASES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(sliding_window=8, query_pre_attn_scalar=32)),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=64,
            q_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),  # fmt: skip
}


def _model(case: str, tmp_path):
    cls, cfg_cls, extra = CASES[case]
    hf = hf_tiny(cls, cfg_cls, **(COMMON | extra))
    hf.save_pretrained(tmp_path)
    config, state = load_hf_dir(tmp_path, dtype=torch.float32, progress=False)
    return build_model(config, state, torch.float32)


def _calib() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_smoothing_alone_keeps_the_function(case, tmp_path):
    """The scales fold into the norms (offset + weight on Gemma) and the linears' columns: the same network."""
    model = _model(case, tmp_path)
    ref = dense_logits(model, _calib())
    compress(model, [SmoothQuantConfig(alpha=0.5)], _calib(), progress=False)
    torch.testing.assert_close(dense_logits(model, _calib()), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_methods_run_through_the_declared_groups(case, tmp_path):
    calib = _calib()
    ref = dense_logits(_model(case, tmp_path / "ref"), calib)
    sqnr = {}
    for name, recipe in {
        "rtn": [RTNConfig(bits=3, group_size=32)],
        "gptq": [GPTQConfig(bits=3, group_size=32)],
        "awq": [AWQConfig(bits=3, group_size=32), RTNConfig(bits=3, group_size=32)],
        "w8a8": [SmoothQuantConfig(alpha=0.5), RTNConfig(bits=8, act_bits=8)],
        "sparsegpt": [SparseGPTConfig(sparsity=0.5)],
        "wanda": [WandaConfig(sparsity=0.5)],
        "magnitude": [MagnitudeConfig(sparsity=0.5)],
    }.items():
        model = _model(case, tmp_path / name)
        compress(model, recipe, calib, progress=False)
        sqnr[name] = sqnr_db(ref, dense_logits(model, calib))
    assert sqnr["gptq"] > sqnr["rtn"] and sqnr["awq"] > sqnr["rtn"]
    assert sqnr["w8a8"] > sqnr["gptq"] + 6  # 8 bits: far above 3 (routing flips bound it on a tiny MoE)
    assert min(sqnr["sparsegpt"], sqnr["wanda"]) > sqnr["magnitude"]
