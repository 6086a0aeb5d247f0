"""Model loading: bundled-model registry, GGUF and safetensors readers, tokenizer and chat template."""

from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf import load_gguf
from leanlm.loading.registry import DEFAULT_MODEL, list_models, pull_model, resolve_model
from leanlm.loading.safetensors import load_hf_dir, save_hf_dir
from leanlm.loading.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "ModelLoadError",
    "load_gguf",
    "DEFAULT_MODEL",
    "list_models",
    "pull_model",
    "resolve_model",
    "load_hf_dir",
    "save_hf_dir",
    "IncrementalDetokenizer",
    "Tokenizer",
]
