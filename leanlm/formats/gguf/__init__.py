"""GGUF checkpoints, read (llama.cpp's one-file format): metadata -> ModelConfig (config.py, moe.py), tensors ->
HF-named float tensors or, in the block formats our kernels compute on, runtime layers (tensors.py, codes.py),
tokenizer keys (tokenizer.py). The bytes are read by loading/gguf_header.py and loading/gguf_file.py (bounded)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.formats.gguf.codes import CODE_TYPES
from leanlm.formats.gguf.config import gguf_model_config
from leanlm.formats.gguf.tensors import gguf_state_dict
from leanlm.formats.gguf.tokenizer import gguf_tokenizer_metadata
from leanlm.formats.load_slice import LoadSlice
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_file import GGUFFile
from leanlm.loading.gguf_file import read_gguf as read_gguf_file
from leanlm.loading.gguf_header import GGUF_MAGIC
from leanlm.loading.gguf_tokenizer import GGUFTokenizerMetadata
from leanlm.loading.shapes import check_checkpoint_shapes
from leanlm.loading.tokenizer import Tokenizer


def is_gguf_file(path: Path) -> bool:
    """True when `path` is a file starting with the GGUF magic (we never trust the extension)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file; any problem becomes a ModelLoadError that says what to do."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(
            f"model file {path} does not exist; check the path, or use a bundled model name (see `leanlm models list`)"
        )
    if not is_gguf_file(path):
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf "
            "model file or a Hugging Face model directory with config.json"
        )
    try:
        return read_gguf_file(path)  # the bounded scan checks every count, length, tensor type and byte range
    except ModelLoadError:
        raise
    except Exception as e:  # what the scan does not model (the big-endian path's GGUFReader, a bad ggml type)
        raise ModelLoadError(
            f"GGUF file {path} has a corrupt or truncated header ({type(e).__name__}: {e}); re-download it, or "
            "re-assemble a bundled model with `leanlm models pull NAME`"
        ) from e


def read_gguf(
    path: Path, dtype: torch.dtype, progress: bool, dequantize_gguf: bool, keep: LoadSlice | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, nn.Module], Tokenizer]:
    """(config, float tensors, quantized layers, tokenizer) of a GGUF file; unless `dequantize_gguf` its Q4_0 / Q4_1 /
    Q4_K / Q5_0 / Q8_0 linears stay codes in runtime layers, else everything is dequantized to `dtype`. `keep`: one
    rank's part only (every tensor's header shape is checked against the metadata before its bytes are read)."""
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    if keep is not None:
        keep.check(config.num_hidden_layers, path)
    state_dict, quantized = gguf_state_dict(
        reader, config, dtype=dtype, progress=progress, dequantize_gguf=dequantize_gguf, keep=keep
    )
    if config.tie_word_embeddings and not dequantize_gguf and _embedding_is_coded(reader):
        # the tied head runs on its own copy of the embedding's codes (on every rank, held or not)
        config = dataclasses.replace(config, tie_word_embeddings=False)
    if keep is None:  # a rank's part was checked tensor by tensor, from the header, before it was read
        check_checkpoint_shapes(config, state_dict, quantized, path)
    return config, state_dict, quantized, Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(reader))


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizerMetadata]:
    """Read config, dequantized HF-named state dict and tokenizer metadata from one GGUF file."""
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    state_dict, _ = gguf_state_dict(reader, config, dtype=dtype, progress=progress)
    return config, state_dict, gguf_tokenizer_metadata(reader)


def _embedding_is_coded(reader: GGUFFile) -> bool:
    """Whether the embedding is stored in a block format the kernels compute on (a tied head then runs on codes)."""
    return any(t.name == "token_embd.weight" and t.tensor_type in CODE_TYPES for t in reader.tensors)
