"""Writing quantized checkpoints: safetensors + `quantization_config.json` (what each quantized layer is);
loading/quantized.py rebuilds them (dispatch on the saved `format` of each layer, never on names)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from leanlm.loading.quantized import FORMAT_VERSION, QUANT_CONFIG_FILE
from leanlm.loading.safetensors import save_hf_dir
from leanlm.model.quantized.linear import QuantLinear


def save_checkpoint(model: nn.Module, path: str | Path, tokenizer=None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `model` (compressed or not) as an HF-style directory that `LLM(path)` / `--model path` loads.

    Float tensors are stored in `dtype`; quantized layers keep their codes and float32 scales as they are.
    The tokenizer defaults to the one `load_model` attached to the model.
    """
    path = Path(path)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    state = float_tensors(model, quantized, dtype)
    for name, layer in quantized.items():
        for key, tensor in layer.state_dict().items():
            state[f"{name}.{key}"] = tensor.to(dtype) if key in layer.compute_dtype_buffers else tensor
    write_model_dir(model, path, state, "lm_head" in quantized, tokenizer)
    meta = {
        "format_version": FORMAT_VERSION,
        "recipe": getattr(model, "compression_recipe", []),
        "layers": {name: m.metadata() for name, m in quantized.items()},
    }
    (path / QUANT_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return path


def float_tensors(model: nn.Module, skip: Collection[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors except those of the `skip` modules, floats in `dtype`; a head tied to the
    embedding is left out (the loader ties it again)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] in skip:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def write_model_dir(
    model: nn.Module, path: Path, state: dict[str, torch.Tensor], head_is_quantized: bool, tokenizer=None
) -> None:
    """config.json + safetensors (+ the tokenizer, by default the one `load_model` attached to the model).
    A quantized head is its own tensor, so the saved config unties it from the embedding."""
    config = model.config
    if head_is_quantized and config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    save_hf_dir(path, config, {k: v.detach().cpu().contiguous() for k, v in state.items()})
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save(path)
