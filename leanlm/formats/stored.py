"""`read_checkpoint`: any model we can run (bundled name, GGUF file, HF directory) -> its stored parts (config,
float tensors, rebuilt quantized layers, tokenizer, recipe), before any network is built.

Dispatch is on the saved metadata (formats/inspect.py: the GGUF magic, quantization_config.json, config.json's
quantization_config block), never on file names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.formats.compressed_tensors import compressed_tensors_layers, read_compressed_tensors_config
from leanlm.formats.gguf import open_gguf, read_gguf
from leanlm.formats.gguf.tokenizer import gguf_tokenizer_metadata
from leanlm.formats.gptq import gptq_layers, read_gptq_config
from leanlm.formats.hf_dir import load_hf_dir
from leanlm.formats.hf_slice import load_hf_dir_slice
from leanlm.formats.inspect import ModelFormat, inspect
from leanlm.formats.load_slice import LoadSlice, own
from leanlm.formats.native import quantized_layers, read_quantization_config
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.registry import resolve_model
from leanlm.loading.shapes import check_checkpoint_shapes
from leanlm.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint as read, ready to build the network from (formats/loader.py does)."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # HF names, float `dtype` (float32 by default); no lm_head when tied
    tokenizer: Tokenizer
    source: Path  # the file or directory it was read from
    # quantized layers by module name, rebuilt from the checkpoint's metadata (their tensors are not in
    # state_dict); empty for float checkpoints
    quantized: dict[str, nn.Module] = field(default_factory=dict)
    recipe: tuple[dict[str, Any], ...] = ()  # the steps that made it, oldest first (native format only)


def read_checkpoint(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    dequantize_gguf: bool = True,
    keep: LoadSlice | None = None,
) -> StoredCheckpoint:
    """Resolve a bundled name or path and read it; every failure is a ModelLoadError saying what to do.

    A GGUF file is dequantized to float when `dequantize_gguf`; otherwise its Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 linears
    (and a tied head in such a format) stay codes in runtime layers (`quantized`), which is how the engine
    runs it. Compression starts from floats. `keep`: only one rank's part of it (formats/load_slice.py): the other
    layers, experts and slices are never read; the config stays the whole model's.
    """
    source = inspect(name_or_path)
    if source.format is ModelFormat.GGUF:
        config, state_dict, quantized, tokenizer = read_gguf(source.path, dtype, progress, dequantize_gguf, keep)
        return StoredCheckpoint(config, state_dict, tokenizer, source.path, quantized)
    return _read_hf_dir(source.path, source.format, dtype, progress, keep)


def _read_hf_dir(
    path: Path, fmt: ModelFormat, dtype: torch.dtype, progress: bool, keep: LoadSlice | None = None
) -> StoredCheckpoint:
    """An HF directory: float, native (quantization_config.json), GPTQ or sparse compressed-tensors (config.json's
    quantization_config block)."""
    try:
        meta = {
            ModelFormat.LEANLM_CHECKPOINT: read_quantization_config,
            ModelFormat.GPTQ: read_gptq_config,
            ModelFormat.COMPRESSED_TENSORS: read_compressed_tensors_config,
        }.get(fmt, lambda _: None)(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    is_quantized = meta is not None
    if keep is None:
        config, state_dict = load_hf_dir(path, dtype=None if is_quantized else dtype, progress=progress)
    else:  # float tensors cut as they are read; a quantized checkpoint's held layers are cut once built (below)
        listed = meta.get("layers") if fmt is ModelFormat.LEANLM_CHECKPOINT else None
        listed = listed if isinstance(listed, dict) else {}
        config, state_dict, whole = load_hf_dir_slice(path, None if is_quantized else dtype, keep, progress, listed)
        if listed:  # the held layers only
            meta = {**meta, "layers": {n: m for n, m in listed.items() if keep.holds(n + ".weight")}}
    build_layers = {
        ModelFormat.LEANLM_CHECKPOINT: quantized_layers,
        ModelFormat.GPTQ: gptq_layers,
        ModelFormat.COMPRESSED_TENSORS: compressed_tensors_layers,
    }
    try:
        quantized = build_layers[fmt](meta, state_dict, config, path) if is_quantized else {}
    except ModelLoadError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # TypeError: a metadata value of the wrong kind
        raise ModelLoadError(f"quantized checkpoint {path} is inconsistent ({e}); re-quantize or re-download it") from e
    if keep is None:  # a rank's float tensors were checked from the header before they were read (and cut), its
        check_checkpoint_shapes(config, state_dict, quantized, path)  # layers by their format against the config
    if keep is not None and is_quantized:  # each layer by its own format's shard(); float modules sliced alike
        quantized = {m: _cut_layer(keep, m, layer) for m, layer in quantized.items()}
        # a layer's format may hand back dense tensors (compressed-tensors' unstructured weights): cut them too
        cut = {n: keep.cut_tensor(n, t) if n.rsplit(".", 1)[0] in whole else t for n, t in state_dict.items()}
        state_dict = {n: t for n, t in cut.items() if t is not None}
    if is_quantized:  # the float tensors (norms, embedding, unquantized linears) in the requested dtype
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    recipe = _recipe(meta, path) if fmt is ModelFormat.LEANLM_CHECKPOINT else ()
    return StoredCheckpoint(config, state_dict, Tokenizer.from_dir(path), path, quantized, recipe)


def _cut_layer(keep: LoadSlice, module: str, layer: nn.Module) -> nn.Module:
    cut = keep.cuts.get(module)
    return layer if cut is None else own(layer.shard(cut.axis, cut.rank, cut.world, cut.sizes))


def _recipe(meta: dict[str, Any], path: Path) -> tuple[dict[str, Any], ...]:
    steps = meta.get("recipe", [])
    if not isinstance(steps, list) or not all(isinstance(s, dict) and "method" in s for s in steps):
        raise ModelLoadError(f"{path}: the recipe in its quantization_config.json is not a list of method steps")
    return tuple(steps)


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """Only the tokenizer of a model (no weights are read): for clients that count or cut tokens."""
    path = resolve_model(name_or_path)
    if path.is_dir():  # a model or a tokenizer-only directory: tokenizer.json (+ tokenizer_config.json)
        return Tokenizer.from_dir(path)
    source = inspect(path)
    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(source.path)))
