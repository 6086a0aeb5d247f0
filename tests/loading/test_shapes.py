"""Checkpoints whose tensors or layers disagree with their own config are refused at load, in every format,
before the network is built or a kernel reads a tensor (issue 34: an int8 checkpoint, consistent with its own
metadata, whose layer 1 MLP was wider than the config's intermediate_size corrupted the heap in the native
decode loop)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from leanlm.compress import GPTQConfig, MagnitudeConfig, RTNConfig, compress
from leanlm.formats import save_checkpoint, save_gptq_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.compressed_tensors import save_compressed_tensors_checkpoint
from leanlm.formats.hf_dir import save_hf_dir
from leanlm.formats.stored import read_checkpoint
from leanlm.kernels import cpu_decode
from leanlm.loading.errors import ModelLoadError
from leanlm.model.layers import Linear
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict

WIDE = 4096  # layer 1's MLP width; the config's intermediate_size is 128


def _config(tokenizer):
    """The tiny config with a head shape the native decode loop runs (head_dim a multiple of 32)."""
    return dataclasses.replace(
        tiny_config(tokenizer.vocab_size), num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )


def _model_with_a_wide_layer(tokenizer, dtype=torch.float32):
    """The tiny model with layer 1's gate/up [256, 64] and down [64, 256]: consistent with itself, not with
    the config it is saved with."""
    cfg = _config(tokenizer)
    model = build_model(cfg, tiny_state_dict(cfg, seed=3), dtype)
    mlp = model.model.layers[1].mlp
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in {"gate_proj": (WIDE, 64), "up_proj": (WIDE, 64), "down_proj": (64, WIDE)}.items():
        linear = Linear(k, n, bias=False, dtype=dtype)
        linear.weight.data.copy_(torch.randn(n, k, generator=gen) * k**-0.5)
        setattr(mlp, name, linear)
    return model


WIDE_MLP = r"model.layers.1.mlp.(gate|up|down)_proj (is a layer of|declares) \(out, in\) features \[\d+, \d+\]"


@pytest.mark.parametrize("fmt", ["leanlm int8", "leanlm int4", "gptq", "compressed-tensors 2:4"])
def test_a_layer_the_config_does_not_describe_is_refused_in_every_format(tokenizer, tmp_path, fmt):
    model = _model_with_a_wide_layer(tokenizer)
    calib = torch.randint(0, tokenizer.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    if fmt == "leanlm int8":
        compress(model, [RTNConfig(bits=8)], progress=False)
        save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    elif fmt == "leanlm int4":
        compress(model, [RTNConfig(bits=4, group_size=32)], progress=False)
        save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    elif fmt == "gptq":
        compress(model, [GPTQConfig(bits=4, group_size=32, symmetric=True)], calib, progress=False)
        save_gptq_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    else:
        compress(model, MagnitudeConfig(pattern="2:4"), progress=False)
        save_compressed_tensors_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    with pytest.raises(ModelLoadError, match=WIDE_MLP):
        read_checkpoint(tmp_path, progress=False)


def test_a_dense_tensor_the_config_does_not_describe_is_refused(tokenizer, tmp_path):
    cfg = tiny_config(tokenizer.vocab_size)
    state = tiny_state_dict(cfg)
    state["model.layers.1.post_attention_layernorm.weight"] = torch.ones(80)
    save_hf_dir(tmp_path, cfg, state)
    with pytest.raises(ModelLoadError, match=r"post_attention_layernorm.weight has shape \[80\], .* gives \[64\]"):
        read_checkpoint(tmp_path, progress=False)


def test_a_quantized_layer_beyond_the_configs_layers_is_refused(tokenizer, tmp_path):
    model = build_model(
        tiny_config(tokenizer.vocab_size), tiny_state_dict(tiny_config(tokenizer.vocab_size)), torch.float32
    )
    compress(model, [RTNConfig(bits=8)], progress=False)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 1  # layer 1's tensors and layers are still there
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "model.layers.1.mlp.down_proj" in meta["layers"]
    with pytest.raises(ModelLoadError, match="is in layer 1, but the config has 1 layers"):
        read_checkpoint(tmp_path, progress=False)


def test_the_wide_int8_checkpoint_no_longer_reaches_the_native_loop(tokenizer, tmp_path):
    """The reproduction, in a child process (a regression would abort it, not pytest): load and generate."""
    model = _model_with_a_wide_layer(tokenizer)
    compress(model, [RTNConfig(bits=8)], progress=False)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    script = textwrap.dedent(
        f"""
        from leanlm import LLM, SamplingParams
        from leanlm.loading.errors import ModelLoadError
        try:
            llm = LLM({str(tmp_path)!r}, dtype="bfloat16", progress=False, kv_cache_memory_bytes=8 << 20)
        except ModelLoadError as e:
            print("refused:", e)
        else:
            llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            print("generated")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("refused:") and "model.layers.1.mlp" in result.stdout


@pytest.mark.skipif(not cpu_decode.is_available(), reason="the native decode loop is not built on this CPU")
def test_the_native_loop_refuses_a_layer_it_cannot_size_and_sizes_from_the_widest(tokenizer):
    """Defence in depth, for a network built without the loaders: the loop is not built over a layer whose
    shapes the model's dimensions do not give (the model runs on PyTorch), and its scratch is sized from the
    widest linear of any layer."""
    from leanlm.model.native_decode import _build_loop

    assert _build_loop(_model_with_a_wide_layer(tokenizer, torch.bfloat16), packed=False) is None
    cfg = _config(tokenizer)
    loop = _build_loop(build_model(cfg, tiny_state_dict(cfg), torch.bfloat16), packed=False)
    heads = 2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
    widest = max(cfg.hidden_size, cfg.intermediate_size)
    assert loop._per_row == cfg.hidden_size + heads + 2 * widest + widest


def _saved(tokenizer, tmp_path, fmt):
    cfg = _config(tokenizer)
    model = build_model(cfg, tiny_state_dict(cfg, seed=2), torch.float32)
    calib = torch.randint(0, tokenizer.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    if fmt == "gptq":
        compress(model, [GPTQConfig(bits=4, group_size=32, symmetric=True)], calib, progress=False)
        save_gptq_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    elif fmt == "int8":
        compress(model, [RTNConfig(bits=8)], progress=False)
        save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    else:
        compress(model, MagnitudeConfig(pattern="2:4"), progress=False)
        save_compressed_tensors_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    return tmp_path


def _edit_tensor(path, name, edit):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    state[name] = edit(state[name]).contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "fmt,name,edit,match",
    [  # found by the fuzzer (tests/loading/quantized_fuzz.py): each crashed, hung or ran to non-finite logits
        ("gptq", "model.layers.0.mlp.up_proj.qweight", lambda t: t.reshape(-1)[0], r"qweight has shape \[\]"),
        ("gptq", "model.layers.0.mlp.up_proj.qweight", lambda t: t[:, :0], "declares .* features"),
        ("gptq", "model.layers.0.mlp.up_proj.scales", lambda t: t.fill_(float("inf")), "infinite or NaN"),
        ("sparse24", "model.layers.0.mlp.up_proj.shape", lambda t: t.fill_(2**40), "declares .* features"),
    ],
)
def test_corrupt_quantized_tensors_are_refused_before_they_are_used(tokenizer, tmp_path, fmt, name, edit, match):
    path = _saved(tokenizer, tmp_path, fmt)
    _edit_tensor(path, name, edit)
    with pytest.raises(ModelLoadError, match=match):
        read_checkpoint(path, progress=False)


def test_metadata_cannot_stand_in_for_a_tensor(tokenizer, tmp_path):
    path = _saved(tokenizer, tmp_path, "int8")
    meta = json.loads((path / "quantization_config.json").read_text())
    meta["layers"]["model.layers.0.mlp.up_proj"]["bias"] = [1, 2, 3]
    (path / "quantization_config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match=r"metadata names \['bias'\], which are tensors"):
        read_checkpoint(path, progress=False)


def test_a_config_claiming_more_layers_than_the_tensors_hold_is_refused_at_once(tokenizer, tmp_path):
    path = _saved(tokenizer, tmp_path, "gptq")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 2**31  # walked layer by layer, this hung the loader
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="says num_hidden_layers = 2147483648, but the tensors hold 2 layers"):
        read_checkpoint(path, progress=False)
