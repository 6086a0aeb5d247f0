"""`load_checkpoint`: the one way a saved model becomes a network: read it (any format, dispatched on its
metadata), let the caller adapt its stored layers (training widens sparse ones), build the network. `LLM`,
`load_model` and training's `load_trainable` all go through it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from leanlm.formats.checkpoint import Checkpoint, require_model_path
from leanlm.formats.load_slice import LoadSlice
from leanlm.formats.stored import StoredCheckpoint, read_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.model.device import resolve_device, resolve_dtype
from leanlm.model.llama import CheckpointMismatchError, build_model
from leanlm.model.materialize import Arrange, build_cut_model


def load_checkpoint(
    name_or_path: str | Path = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    *,
    attention_backend: str = "auto",
    progress: bool = True,
    dequantize_gguf: bool = True,
    adapt: Callable[[StoredCheckpoint], StoredCheckpoint] | None = None,
    keep: LoadSlice | None = None,
    arrange: Arrange | None = None,
) -> Checkpoint:
    """A bundled name, GGUF file or (quantized) HF directory as a Checkpoint: the network in `dtype` ("auto":
    what runs fastest on `device`) on `device`, its tokenizer and recipe.

    dequantize_gguf: dequantize a GGUF file's block-quantized linears to float (compression starts from floats);
    False keeps them as codes, which is how the engine (LLM) runs it. adapt: maps the stored parts before the
    network is built (its layers and tensors; the config must stay what they fit).

    keep, arrange (together): one rank's part only. `keep` says what is read (formats/load_slice.py); `arrange` cuts
    the network, built on the meta device, to the same part (model/materialize.py), so the whole model is never
    in memory."""
    if (keep is None) != (arrange is None):
        raise ValueError("load_checkpoint: keep (what to read) and arrange (the network cut alike) go together")
    require_model_path(name_or_path, "load_checkpoint")
    device = resolve_device(device)
    stored = read_checkpoint(name_or_path, progress=progress, dequantize_gguf=dequantize_gguf, keep=keep)
    if adapt is not None:
        stored = adapt(stored)
    dtype = resolve_dtype(dtype, device, stored.config)
    try:
        if keep is None:
            model = build_model(
                stored.config, stored.state_dict, dtype, device, attention_backend, quantized=stored.quantized
            )
        else:
            parts = (stored.state_dict, dtype, device, attention_backend, stored.quantized, arrange)
            model = build_cut_model(stored.config, *parts)
    except CheckpointMismatchError as e:  # not a bad argument (an unknown attention backend stays a ValueError)
        raise ModelLoadError(f"{stored.source}: {e}; re-export or re-download the model") from e
    return Checkpoint(model, stored.tokenizer, stored.recipe, stored.source)
