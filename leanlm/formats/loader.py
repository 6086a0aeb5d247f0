"""`load_checkpoint`: the one way a saved model becomes a network: read it (any format, dispatched on its
metadata), let the caller adapt its stored layers (training widens sparse ones), build the network. `LLM`,
`load_model` and training's `load_trainable` all go through it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from leanlm.formats.checkpoint import Checkpoint, require_model_path
from leanlm.formats.stored import StoredCheckpoint, read_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.model.device import resolve_device, resolve_dtype
from leanlm.model.llama import CheckpointMismatchError, build_model


def load_checkpoint(
    name_or_path: str | Path = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    *,
    attention_backend: str = "auto",
    progress: bool = True,
    dequantize_gguf: bool = True,
    adapt: Callable[[StoredCheckpoint], StoredCheckpoint] | None = None,
) -> Checkpoint:
    """A bundled name, GGUF file or (quantized) HF directory as a Checkpoint: the network in `dtype` ("auto":
    what runs fastest on `device`) on `device`, its tokenizer and recipe.

    dequantize_gguf: dequantize a GGUF file's block-quantized linears to float (compression starts from floats);
    False keeps them as codes, which is how the engine (LLM) runs it. adapt: maps the stored parts before the
    network is built (its layers and tensors; the config must stay what they fit)."""
    require_model_path(name_or_path, "load_checkpoint")
    device = resolve_device(device)
    stored = read_checkpoint(name_or_path, progress=progress, dequantize_gguf=dequantize_gguf)
    if adapt is not None:
        stored = adapt(stored)
    dtype = resolve_dtype(dtype, device, stored.config)
    try:
        model = build_model(
            stored.config, stored.state_dict, dtype, device, attention_backend, quantized=stored.quantized
        )
    except CheckpointMismatchError as e:  # not a bad argument (an unknown attention backend stays a ValueError)
        raise ModelLoadError(f"{stored.source}: {e}; re-export or re-download the model") from e
    return Checkpoint(model, stored.tokenizer, stored.recipe, stored.source)
