"""The HF-style directory every directory format shares: config.json, safetensors and the tokenizer files;
each format adds its own tensors and metadata on top."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.hf_dir import save_hf_dir


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
    checkpoint: Checkpoint, path: Path, state: dict[str, torch.Tensor], head_is_quantized: bool
) -> None:
    """config.json + safetensors (+ the checkpoint's tokenizer). A quantized head is its own tensor, so the saved
    config unties it from the embedding."""
    config = checkpoint.config
    if head_is_quantized and config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    save_hf_dir(path, config, {k: v.detach().cpu().contiguous() for k, v in state.items()})
    if checkpoint.tokenizer is not None:
        checkpoint.tokenizer.save(path)
