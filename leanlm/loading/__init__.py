"""Model loading below the checkpoint formats: bundled-model registry, bounded GGUF and safetensors header readers,
tokenizer and chat template (formats/ reads and writes the checkpoints on them)."""

from leanlm.loading.errors import ModelLoadError
from leanlm.loading.registry import DEFAULT_MODEL, list_models, pull_model, resolve_model
from leanlm.loading.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "ModelLoadError",
    "DEFAULT_MODEL",
    "list_models",
    "pull_model",
    "resolve_model",
    "IncrementalDetokenizer",
    "Tokenizer",
]
