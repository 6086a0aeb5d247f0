"""A model to train: any checkpoint the engine loads, built in float32 with every linear a float linear.

Sparse layers (Sparse24Linear, BitmaskSparseLinear) are widened back to float weights with their zeros, so a
model pruned by `leanlm prune` can be fine-tuned and packed again; other quantized layers have no float weight to train
(quantization-aware training is a separate method), so they are refused with what to do instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from leanlm.loading.checkpoint import load_checkpoint
from leanlm.loading.quantized import read_quantization_config
from leanlm.model.device import resolve_device
from leanlm.model.llama import LlamaForCausalLM, build_model
from leanlm.model.sparse.bitmask import BitmaskSparseLinear
from leanlm.model.sparse.semi_structured import Sparse24Linear


def load_trainable(name_or_path: str | Path, device: str | None = None) -> tuple[LlamaForCausalLM, object]:
    """(model in float32 on `device`, its tokenizer); the model carries the recipe its checkpoint recorded."""
    ckpt = load_checkpoint(name_or_path)
    state = dict(ckpt.state_dict)
    for name, layer in ckpt.quantized.items():
        if not isinstance(layer, (Sparse24Linear, BitmaskSparseLinear)):
            raise ValueError(
                f"{ckpt.source}: {name} is a {getattr(layer, 'format', type(layer).__name__)} layer, which has no "
                "float weight to train; fine-tune the float (or pruned) model and quantize after"
            )
        state[f"{name}.weight"] = layer.dequantized_weight()
        if layer.bias is not None:
            state[f"{name}.bias"] = layer.bias.float()
    model = build_model(ckpt.config, state, torch.float32, resolve_device(device))
    meta = read_quantization_config(ckpt.source) if Path(ckpt.source).is_dir() else None
    model.compression_recipe = list(meta.get("recipe", [])) if meta else []
    return model, ckpt.tokenizer
