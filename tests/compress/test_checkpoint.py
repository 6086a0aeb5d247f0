"""Quantized checkpoints: exact round trips (ours and the GPTQ layout), loading through LLM, errors."""

import json

import pytest
import torch

from leanlm.compress import GPTQConfig, LLMInt8Config, RTNConfig, compress, save_checkpoint, save_gptq_checkpoint
from leanlm.compress.gptq_format import (
    from_gptq_tensors, pack_int32_rows, to_gptq_tensors, unpack_int32_rows,
)
from leanlm.compress.qlinear import IntGroupWeightOnlyLinear, QuantLinear
from leanlm.loading.checkpoint import load_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.model.llama import build_model
from tests.compress.conftest import dense_logits


def _reload(path, dtype=torch.float32):
    ckpt = load_checkpoint(path, progress=False)
    return build_model(ckpt.config, ckpt.state_dict, dtype, quantized=ckpt.quantized)


@pytest.mark.parametrize("recipe", [
    [RTNConfig(bits=4, group_size=32, ignore=())], [RTNConfig(bits=8, group_size=None)],
    [RTNConfig(bits=8, group_size=None, act_bits=8)], [GPTQConfig(bits=3, group_size=32)], [LLMInt8Config()],
])
def test_checkpoint_round_trip_is_exact(tiny_model, calib, tokenizer, tmp_path, recipe):
    model = tiny_model()
    compress(model, recipe, calib, progress=False)
    save_checkpoint(model, tmp_path, tokenizer, dtype=torch.float32)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    assert meta["recipe"][0]["method"] == recipe[0].name
    loaded = _reload(tmp_path)
    names = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert names == {n for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert torch.equal(dense_logits(model, calib), dense_logits(loaded, calib))


def test_bf16_checkpoint_loads_for_inference(tiny_model, calib, tokenizer, tmp_path):
    model = tiny_model()
    compress(model, [RTNConfig(bits=4, group_size=64)], None, progress=False)
    save_checkpoint(model, tmp_path, tokenizer)  # floats in bfloat16
    loaded = _reload(tmp_path, torch.bfloat16)
    q = loaded.model.layers[0].mlp.down_proj
    assert isinstance(q, IntGroupWeightOnlyLinear) and q.scales.dtype == torch.float32
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    ref = dense_logits(model, calib)
    assert torch.allclose(dense_logits(loaded, calib).float(), ref, atol=0.15 * ref.abs().max().item())


def test_int32_packing_round_trips():
    codes = torch.randint(0, 16, (64, 24))
    packed = pack_int32_rows(codes)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(unpack_int32_rows(packed), codes)
    assert int(packed[0, 0]) & 0xF == int(codes[0, 0])  # the first row in the lowest bits


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layout_matches_the_reference_dequantization(act_order):
    """Dequantize the exported tensors with the AutoGPTQ formula, independently of our importer."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen)
    w = torch.randn(64, 128, generator=gen) / 10
    from leanlm.compress.gptq import gptq_quantize
    from leanlm.compress.scheme import build_module

    cfg = GPTQConfig(bits=4, group_size=32, symmetric=True, act_order=act_order)
    res = gptq_quantize(w, 2 * x.t() @ x / 512, cfg)
    layer = build_module(res.codes, res.qparams, cfg, None, res.perm)
    t = to_gptq_tensors(layer)
    assert t["qweight"].shape == (16, 64) and t["qzeros"].shape == (4, 8) and t["scales"].shape == (4, 64)
    q = unpack_int32_rows(t["qweight"])  # [K, N]
    zeros = unpack_int32_rows(t["qzeros"].t().contiguous()).t() + 1  # [G, N]
    g = t["g_idx"].long()
    w_ref = (q - zeros[g]) * t["scales"].float()[g]  # [K, N]
    assert torch.allclose(w_ref.t(), layer.dequantized_weight(), atol=2e-3)
    assert torch.equal(t["g_idx"].long().sort().values, torch.arange(128) // 32)
    # import gives the same layer back, and exporting that again gives identical tensors
    back = from_gptq_tensors(t, 32)
    assert torch.equal(back.dequantized_weight(), w_ref.t())
    again = to_gptq_tensors(back)
    assert all(torch.equal(t[k], again[k]) for k in t)


def test_gptq_checkpoint_loads_back(tiny_model, calib, tokenizer, tmp_path):
    model = tiny_model()
    compress(model, [GPTQConfig(bits=4, group_size=32, symmetric=True)], calib, progress=False)
    save_gptq_checkpoint(model, tmp_path, tokenizer)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == {**cfg["quantization_config"], "quant_method": "gptq", "bits": 4,
                                          "group_size": 32, "desc_act": True, "sym": True}
    assert not (tmp_path / "quantization_config.json").exists()
    loaded = _reload(tmp_path)
    ref, out = dense_logits(model, calib), dense_logits(loaded, calib)
    assert torch.allclose(out, ref, atol=1e-2 * ref.abs().max().item())


def test_gptq_export_refuses_other_formats(tiny_model, tmp_path):
    model = tiny_model()
    compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    with pytest.raises(ValueError, match="4-bit group-wise"):
        save_gptq_checkpoint(model, tmp_path)


def test_unknown_format_is_a_clear_load_error(tiny_model, tokenizer, tmp_path):
    model = tiny_model()
    compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    save_checkpoint(model, tmp_path, tokenizer)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    first = next(iter(meta["layers"]))
    meta["layers"][first]["format"] = "int5_magic"
    (tmp_path / "quantization_config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="int5_magic"):
        load_checkpoint(tmp_path, progress=False)
