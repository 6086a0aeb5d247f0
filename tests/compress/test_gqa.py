"""MHA -> GQA / MQA conversion: exact where a group's heads already agree (mean-pool and first head), the head
count saved and loaded back, biases (Qwen2) pooled with their weights, and the errors for what cannot convert."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.compress import GQAConfig, RTNConfig, compress
from leanlm.compress.transform.gqa import group_heads
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.llm import load_model
from tests.compress.conftest import dense_logits


def _share_kv_heads(model) -> None:
    """Make K/V head 1 a copy of head 0 in every layer (the model then computes as if it had one K/V head)."""
    d = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[d : 2 * d] = proj.weight[:d]
                if proj.bias is not None:
                    proj.bias[d : 2 * d] = proj.bias[:d]


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("init", ["mean", "first"])
def test_heads_that_agree_convert_exactly(tiny_model, calib, architecture, init):
    model = tiny_model(torch.float64, architecture=architecture)  # 4 query heads, 2 K/V heads
    _share_kv_heads(model)
    before = dense_logits(model, calib[:2])
    compress(model, [GQAConfig(num_key_value_heads=1, init=init)], progress=False)
    attn = model.model.layers[0].self_attn
    assert model.config.num_key_value_heads == 1 and attn.num_kv_heads == 1
    assert attn.k_proj.weight.shape == (16, 64) and attn.v_proj.weight.shape == (16, 64)
    assert (attn.k_proj.bias is not None) == (architecture == "qwen2")
    assert torch.allclose(dense_logits(model, calib[:2]), before, atol=1e-10)


def test_mean_pool_averages_each_group_and_random_keeps_only_the_scale():
    weight = torch.arange(4 * 2 * 3, dtype=torch.float64).reshape(4 * 2, 3)  # 4 heads of dim 2
    bias = torch.arange(8, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    w, b = group_heads(weight, bias, 2, 2, "mean", gen)  # heads (0, 1) -> 0, (2, 3) -> 1
    assert torch.equal(w, torch.stack([(weight[0:2] + weight[2:4]) / 2, (weight[4:6] + weight[6:8]) / 2]).reshape(4, 3))
    assert torch.equal(b, torch.tensor([1.0, 2.0, 5.0, 6.0], dtype=torch.float64))
    w, b = group_heads(weight, bias, 2, 2, "first", gen)
    assert torch.equal(w, torch.cat([weight[0:2], weight[4:6]]))
    assert torch.equal(b, torch.tensor([0.0, 1, 4, 5], dtype=torch.float64))
    big = torch.randn(64 * 4, 32, generator=gen)
    w, b = group_heads(big, None, 1, 64, "random", gen)
    assert w.shape == (64, 32) and b is None and abs(float(w.std()) / float(big.std()) - 1) < 0.05


def test_the_converted_model_saves_and_loads_with_its_new_head_count(tmp_path, tiny_model, calib, tokenizer):
    model = tiny_model()
    report = compress(model, [GQAConfig(num_key_value_heads=1)], progress=False)
    assert report.linears == []  # a transform: no layer is quantized
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 1
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config.num_key_value_heads == 1
    with torch.inference_mode():
        assert torch.allclose(dense_logits(loaded, calib[:2]), dense_logits(model, calib[:2]), atol=1e-5)


def test_what_cannot_convert_says_what_to_do(tiny_model):
    with pytest.raises(ValueError, match="divides 2"):
        compress(tiny_model(heads=6, kv_heads=2), [GQAConfig(num_key_value_heads=3)], progress=False)
    quantized = tiny_model()
    compress(quantized, [RTNConfig(bits=8)], progress=False)
    with pytest.raises(ValueError, match="before any quantizer"):
        compress(quantized, [GQAConfig(num_key_value_heads=1)], progress=False)
    with pytest.raises(ValueError, match="init must be one of"):
        GQAConfig(init="svd")
    with pytest.raises(ValueError, match=">= 1"):
        GQAConfig(num_key_value_heads=0)
