"""`load_checkpoint`: any model we can run (bundled name, GGUF file, HF directory) -> config, weights, tokenizer.

Dispatch is on what the path *is* (a directory with config.json, a file starting with b'GGUF'), never on
its extension.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.loading.compressed_tensors import compressed_tensors_layers, read_compressed_tensors_config
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf import gguf_model_config, gguf_state_dict, gguf_tokenizer_metadata, open_gguf
from leanlm.loading.inspect import inspect
from leanlm.loading.quantized import gptq_layers, quantized_layers, read_gptq_config, read_quantization_config
from leanlm.loading.registry import resolve_model
from leanlm.loading.safetensors import load_hf_dir
from leanlm.loading.shapes import check_checkpoint_shapes
from leanlm.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model, ready to build the network from."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # HF names, float `dtype` (float32 by default); no lm_head when tied
    tokenizer: Tokenizer
    source: Path  # the file or directory it was read from
    # quantized layers by module name, rebuilt from the checkpoint's metadata (their tensors are not in
    # state_dict); empty for float checkpoints
    quantized: dict[str, nn.Module] = field(default_factory=dict)


def load_checkpoint(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True, gguf_codes: bool = False
) -> Checkpoint:
    """Resolve a bundled name or path and load it; every failure is a ModelLoadError saying what to do.

    A GGUF file is dequantized to float unless `gguf_codes`: then its Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 linears
    (and a tied head in such a format) stay codes in runtime layers (`quantized`), which is how the engine
    runs it. Compression starts from floats.
    """
    source = inspect(name_or_path)
    if source.is_directory:
        return _load_hf_checkpoint(source.path, dtype, progress)
    reader = open_gguf(source.path)
    config = gguf_model_config(reader)
    state_dict, quantized = gguf_state_dict(reader, config, dtype=dtype, progress=progress, keep_codes=gguf_codes)
    if "lm_head" in quantized:  # the tied head runs on its own copy of the embedding's codes
        config = dataclasses.replace(config, tie_word_embeddings=False)
    meta = gguf_tokenizer_metadata(reader)
    check_checkpoint_shapes(config, state_dict, quantized, source.path)
    return Checkpoint(config, state_dict, Tokenizer.from_gguf_metadata(meta), source.path, quantized)


def _load_hf_checkpoint(path: Path, dtype: torch.dtype, progress: bool) -> Checkpoint:
    """An HF directory: float, leanlm-quantized (quantization_config.json), GPTQ or sparse compressed-tensors
    (config.json's quantization_config block)."""
    try:
        meta, gptq, sparse = (
            read_quantization_config(path),
            read_gptq_config(path),
            read_compressed_tensors_config(path),
        )
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    is_quantized = meta is not None or gptq is not None or sparse is not None
    config, state_dict = load_hf_dir(path, dtype=None if is_quantized else dtype, progress=progress)
    try:
        if meta is not None:
            quantized = quantized_layers(meta, state_dict, config, path)
        elif gptq is not None:
            quantized = gptq_layers(gptq, state_dict, config, path)
        elif sparse is not None:
            quantized = compressed_tensors_layers(sparse, state_dict, config, path)
        else:
            quantized = {}
    except ModelLoadError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # TypeError: a metadata value of the wrong kind
        raise ModelLoadError(f"quantized checkpoint {path} is inconsistent ({e}); re-quantize or re-download it") from e
    check_checkpoint_shapes(config, state_dict, quantized, path)
    if is_quantized:  # the float tensors (norms, embedding, unquantized linears) in the requested dtype
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    return Checkpoint(config, state_dict, Tokenizer.from_dir(path), path, quantized)


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """Only the tokenizer of a model (no weights are read): for clients that count or cut tokens."""
    path = resolve_model(name_or_path)
    if path.is_dir():  # a model or a tokenizer-only directory: tokenizer.json (+ tokenizer_config.json)
        return Tokenizer.from_dir(path)
    source = inspect(path)
    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(source.path)))
