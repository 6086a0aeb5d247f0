"""Checkpoint formats, one unit each, read and written together: native.py (LeanLM's own: safetensors +
quantization_config.json), gptq.py, compressed_tensors.py, hf_dir.py (plain HF directories), gguf/ (read only). A
Checkpoint carries the model, its tokenizer and recipe; `load_checkpoint` (loader.py) is the one loader, dispatching
on saved metadata."""

from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.compressed_tensors import save_compressed_tensors_checkpoint
from leanlm.formats.gptq import save_gptq_checkpoint
from leanlm.formats.inspect import ModelFormat, ModelSource, inspect
from leanlm.formats.loader import load_checkpoint
from leanlm.formats.native import save_checkpoint
from leanlm.formats.stored import StoredCheckpoint, load_tokenizer, read_checkpoint

__all__ = [
    "Checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "save_gptq_checkpoint",
    "save_compressed_tensors_checkpoint",
    "StoredCheckpoint",
    "read_checkpoint",
    "load_tokenizer",
    "ModelFormat",
    "ModelSource",
    "inspect",
]
