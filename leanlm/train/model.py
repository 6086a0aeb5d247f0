"""A model to train: any checkpoint the engine loads, built in float32 with every linear a float linear.

Sparse layers (Sparse24Linear, BitmaskSparseLinear) are widened back to float weights with their zeros, so a
model pruned by `leanlm prune` can be fine-tuned and packed again. Quantized layers have no float weight to train: they
are refused with what to do instead, unless the caller keeps them for quantization-aware training (the int8 and
2-4 bit weight-only layers a FakeQuantLinear stands in for).
"""

from __future__ import annotations

from pathlib import Path

import torch

from leanlm.loading.checkpoint import load_checkpoint
from leanlm.loading.quantized import read_quantization_config
from leanlm.model.device import resolve_device
from leanlm.model.llama import LlamaForCausalLM, build_model
from leanlm.model.quantized.fake_quant import TRAINABLE
from leanlm.model.sparse.bitmask import BitmaskSparseLinear
from leanlm.model.sparse.semi_structured import Sparse24Linear


def load_trainable(
    name_or_path: str | Path, device: str | None = None, keep_quantized: bool = False
) -> tuple[LlamaForCausalLM, object]:
    """(model in float32 on `device`, its tokenizer); the model carries the recipe its checkpoint recorded.
    keep_quantized: keep the int8 / 2-4 bit weight-only layers as they are (for QAT), refuse the rest."""
    ckpt = load_checkpoint(name_or_path)
    state, kept = dict(ckpt.state_dict), {}
    for name, layer in ckpt.quantized.items():
        if keep_quantized and type(layer) in TRAINABLE:
            kept[name] = layer
            continue
        if keep_quantized and not isinstance(layer, (Sparse24Linear, BitmaskSparseLinear)):
            raise ValueError(
                f"{ckpt.source}: {name} is a {getattr(layer, 'format', type(layer).__name__)} layer, which QAT cannot "
                "train: it trains int8 and 2-4 bit weight-only layers stored in input order (GPTQ: --static-groups "
                "or --no-act-order)"
            )
        if not isinstance(layer, (Sparse24Linear, BitmaskSparseLinear)):
            raise ValueError(
                f"{ckpt.source}: {name} is a {getattr(layer, 'format', type(layer).__name__)} layer, which has no "
                "float weight to train; fine-tune the float (or pruned) model and quantize after"
            )
        state[f"{name}.weight"] = layer.dequantized_weight()
        if layer.bias is not None:
            state[f"{name}.bias"] = layer.bias.float()
    if keep_quantized and not kept:
        raise ValueError(f"{ckpt.source} has no quantized layers to train: pass --qat-bits to quantize it first")
    model = build_model(ckpt.config, state, torch.float32, resolve_device(device), quantized=kept)
    meta = read_quantization_config(ckpt.source) if Path(ckpt.source).is_dir() else None
    model.compression_recipe = list(meta.get("recipe", [])) if meta else []
    return model, ckpt.tokenizer
