"""GGUF checkpoints, read (llama.cpp's one-file format: metadata, tokenizer and block-quantized tensors). The
file itself is parsed by loading/gguf*.py; this module turns it into a checkpoint's parts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.loading.gguf import gguf_model_config, gguf_state_dict, gguf_tokenizer_metadata, open_gguf
from leanlm.loading.shapes import check_checkpoint_shapes
from leanlm.loading.tokenizer import Tokenizer


def read_gguf(
    path: Path, dtype: torch.dtype, progress: bool, keep_codes: bool
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, nn.Module], Tokenizer]:
    """(config, float tensors, quantized layers, tokenizer) of a GGUF file; with `keep_codes` its Q4_0 / Q4_1 /
    Q4_K / Q5_0 / Q8_0 linears stay codes in runtime layers, else everything is dequantized to `dtype`."""
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    state_dict, quantized = gguf_state_dict(reader, config, dtype=dtype, progress=progress, keep_codes=keep_codes)
    if "lm_head" in quantized:  # the tied head runs on its own copy of the embedding's codes
        config = dataclasses.replace(config, tie_word_embeddings=False)
    check_checkpoint_shapes(config, state_dict, quantized, path)
    return config, state_dict, quantized, Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(reader))
