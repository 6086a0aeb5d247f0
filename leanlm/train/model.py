"""A model to train: any checkpoint the engine loads, built in float32 with every linear a float linear.

Sparse layers (Sparse24Linear, BitmaskSparseLinear) are widened back to float weights with their zeros, so a
model pruned by `leanlm prune` can be fine-tuned and packed again. Quantized layers have no float weight to train: they
are refused with what to do instead, unless the caller keeps them for quantization-aware training (the int8 and
2-4 bit weight-only layers a FakeQuantLinear stands in for).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.loader import load_checkpoint
from leanlm.formats.stored import StoredCheckpoint
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.quantized.fake_quant import TRAINABLE


def load_trainable(name_or_path: str | Path, device: str | None = None, keep_quantized: bool = False) -> Checkpoint:
    """The checkpoint with its model in float32 on `device` (its tokenizer and recorded recipe with it).
    keep_quantized: keep the int8 / 2-4 bit weight-only layers as they are (for QAT), refuse the rest."""
    return load_checkpoint(name_or_path, "float32", device, adapt=partial(_trainable, keep_quantized=keep_quantized))


def _trainable(ckpt: StoredCheckpoint, keep_quantized: bool) -> StoredCheckpoint:
    """Sparse layers widened to float weights, QAT's layers kept when asked; any other layer is a ValueError."""
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
    return dataclasses.replace(ckpt, state_dict=state, quantized=kept)
