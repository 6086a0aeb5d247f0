"""Quantized checkpoints: exact round trips (ours and the GPTQ layout), loading through LLM, errors."""

import json

import pytest
import torch

from leanlm.compress import FP8Config, GPTQConfig, LLMInt8Config, RTNConfig, SparseGPTConfig, WandaConfig, compress
from leanlm.formats import save_checkpoint, save_gptq_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.gptq import (
    from_gptq_tensors,
    pack_int32_rows,
    to_gptq_tensors,
    unpack_int32_rows,
)
from leanlm.formats.stored import read_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from tests.compress.conftest import dense_logits


def _reload(path, dtype=torch.float32):
    ckpt = read_checkpoint(path, progress=False)
    return build_model(ckpt.config, ckpt.state_dict, dtype, quantized=ckpt.quantized)


@pytest.mark.parametrize(
    "recipe",
    [
        [RTNConfig(bits=4, group_size=32, ignore=())],
        [RTNConfig(bits=8, group_size=None)],
        [RTNConfig(bits=8, group_size=None, act_bits=8)],
        [GPTQConfig(bits=3, group_size=32)],
        [LLMInt8Config()],
        [FP8Config()],  # float8 buffers: the loader's finiteness check must read them (torch.isfinite cannot)
        [WandaConfig(pattern="2:4")],  # packed: Sparse24Linear's values + bitmask
        [WandaConfig(sparsity=0.5)],  # unstructured: an ordinary dense checkpoint with zeros
        [SparseGPTConfig(pattern="2:4"), GPTQConfig(bits=4, group_size=32)],
    ],
)
def test_checkpoint_round_trip_is_exact(tiny_model, calib, tokenizer, tmp_path, recipe):
    model = tiny_model()
    report = compress(model, recipe, calib, progress=False)
    save_checkpoint(Checkpoint(model, tokenizer).with_recipe(report.recipe), tmp_path, dtype=torch.float32)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    assert [step["method"] for step in meta["recipe"]] == [cfg.name for cfg in recipe]
    loaded = _reload(tmp_path)
    names = {n for n, m in model.named_modules() if isinstance(m, RuntimeLinear)}
    assert names == {n for n, m in loaded.named_modules() if isinstance(m, RuntimeLinear)}
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert torch.equal(dense_logits(model, calib), dense_logits(loaded, calib))


def test_bf16_checkpoint_loads_for_inference(tiny_model, calib, tokenizer, tmp_path):
    model = tiny_model()
    compress(model, [RTNConfig(bits=4, group_size=64)], None, progress=False)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path)  # floats in bfloat16
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
    from leanlm.compress.quantize.gptq import gptq_quantize
    from leanlm.compress.quantize.int_scheme import build_module

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
    save_gptq_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"] == {
        **cfg["quantization_config"],
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": True,
        "sym": True,
    }
    assert not (tmp_path / "quantization_config.json").exists()
    loaded = _reload(tmp_path)
    ref, out = dense_logits(model, calib), dense_logits(loaded, calib)
    assert torch.allclose(out, ref, atol=1e-2 * ref.abs().max().item())


def test_gptq_export_refuses_other_formats(tiny_model, tmp_path):
    model = tiny_model()
    compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    with pytest.raises(ValueError, match="4-bit group-wise"):
        save_gptq_checkpoint(Checkpoint(model, None), tmp_path)


def test_unknown_format_is_a_clear_load_error(tiny_model, tokenizer, tmp_path):
    model = tiny_model()
    compress(model, [RTNConfig(bits=8, group_size=None)], None, progress=False)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    first = next(iter(meta["layers"]))
    meta["layers"][first]["format"] = "int5_magic"
    (tmp_path / "quantization_config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="int5_magic"):
        read_checkpoint(tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------- hostile files
# A checkpoint directory is untrusted input: its shapes and indices reach native kernels that do not check them.


_SAVED: dict[str, object] = {}  # built once per session: compressing is the slow part


@pytest.fixture
def saved_checkpoints(tmp_path_factory, tiny_model, calib, tokenizer):
    """Intact checkpoints (int4 with an act-order perm, LLM.int8) to damage one tensor or key at a time."""
    for name, recipe in (("int4", [GPTQConfig(bits=4, group_size=32)]), ("llm_int8", [LLMInt8Config()])):
        if name not in _SAVED:
            model = tiny_model()
            compress(model, recipe, calib, progress=False)
            _SAVED[name] = save_checkpoint(
                Checkpoint(model, tokenizer), tmp_path_factory.mktemp(name), dtype=torch.float32
            )
    return _SAVED


def _damaged(saved, tmp_path, tensors=None, layers=None):
    """A copy of `saved` with tensors edited (name suffix -> fn(tensor)) and layer metadata updated."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    layer = "model.layers.0.mlp.down_proj"
    for suffix, edit in (tensors or {}).items():
        state[f"{layer}.{suffix}"] = edit(state[f"{layer}.{suffix}"]).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    meta["layers"][layer].update(layers or {})
    (tmp_path / "quantization_config.json").write_text(json.dumps(meta))
    return tmp_path


def _swap_first_two(t):
    t = t.clone()
    t[0] = t[1]
    return t


def _set_first(value):
    def edit(t):
        t = t.clone()
        t[0] = value
        return t

    return edit


INT4_DAMAGE = {
    "perm out of range": ({"perm": _set_first(10**6)}, {}, r"perm holds indices outside \[0, 128\)"),
    "perm negative": ({"perm": _set_first(-1)}, {}, r"perm holds indices outside"),
    "perm repeats": ({"perm": _swap_first_two}, {}, "perm repeats an index"),
    "perm too short": ({"perm": lambda t: t[:-1]}, {}, "perm has 127 entries"),
    "perm of floats": ({"perm": lambda t: t.float()}, {}, "perm must be a 1-D integer tensor"),
    "scales short": ({"scales": lambda t: t[:, :-1]}, {}, "scales .* do not match"),
    "mins short": ({"mins": lambda t: t[:-1]}, {}, r"mins has shape \[63, 4\]; expected \[64, 4\]"),
    "qweight a vector": ({"qweight": lambda t: t.reshape(-1)}, {}, "qweight has shape"),
    "bias wrong length": ({"bias": None}, {}, "bias has shape"),
    "group_size zero": ({}, {"group_size": 0}, "group_size 0 must be a positive integer"),
    "group_size not dividing": ({}, {"group_size": 48}, "group_size 48 must be a positive integer dividing"),
    "group_size a string": ({}, {"group_size": "32"}, "group_size '32'"),
    "bits a string": ({}, {"bits": "4"}, "2-4 bit codes"),
    # checked against the model config before the layer is built (loading/shapes.py)
    "in_features lie": ({}, {"in_features": 256}, r"down_proj declares \(out, in\) features \[64, 256\], but"),
    "unknown key": ({}, {"zero_point": 3}, "unexpected keyword"),
}


@pytest.mark.parametrize("case", list(INT4_DAMAGE))
def test_damaged_int4_checkpoint_is_refused(saved_checkpoints, tmp_path, case):
    tensors, layers, match = INT4_DAMAGE[case]
    if tensors.get("bias", 0) is None:  # down_proj has no bias: add one of the wrong length
        from safetensors.torch import load_file, save_file

        path = _damaged(saved_checkpoints["int4"], tmp_path)
        state = load_file(str(path / "model.safetensors"))
        state["model.layers.0.mlp.down_proj.bias"] = torch.zeros(3)
        save_file(state, str(path / "model.safetensors"))
    else:
        path = _damaged(saved_checkpoints["int4"], tmp_path, tensors, layers)
    prefix = "" if case == "in_features lie" else "inconsistent .*layer model.layers.0.mlp.down_proj: .*"
    with pytest.raises(ModelLoadError, match=prefix + match):
        read_checkpoint(path, progress=False)


def test_damaged_llm_int8_checkpoint_is_refused(saved_checkpoints, tmp_path):
    path = _damaged(saved_checkpoints["llm_int8"], tmp_path, {"outlier_idx": _set_first(10**6)})
    with pytest.raises(ModelLoadError, match=r"outlier_idx holds indices outside \[0, 128\)"):
        read_checkpoint(path, progress=False)


def test_intact_checkpoints_still_load(saved_checkpoints):
    ckpt = read_checkpoint(saved_checkpoints["int4"], progress=False)
    layer = ckpt.quantized["model.layers.0.mlp.down_proj"]
    assert layer.perm is not None and torch.equal(layer.perm.sort().values, torch.arange(128))


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: {**t, "qzeros": t["qzeros"][:-1].contiguous()}, r"qzeros \[3, 8\] do not match"),
        (lambda t: {**t, "g_idx": _set_first(7)(t["g_idx"])}, r"g_idx holds groups outside \[0, 4\)"),
    ],
)
def test_damaged_gptq_checkpoint_is_refused(tiny_model, calib, tokenizer, tmp_path, edit, match):
    from safetensors.torch import load_file, save_file

    model = tiny_model()
    compress(model, [GPTQConfig(bits=4, group_size=32, symmetric=True)], calib, progress=False)
    save_gptq_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    prefix = "model.layers.0.mlp.down_proj."
    layer = edit({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    save_file({**state, **{prefix + k: v for k, v in layer.items()}}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=match):
        read_checkpoint(tmp_path, progress=False)
