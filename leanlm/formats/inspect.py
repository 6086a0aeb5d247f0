"""inspect(path): what a model argument is (a GGUF file, a Hugging Face safetensors directory, a LeanLM
checkpoint, a GPTQ or a sparse compressed-tensors directory) once a bundled name is resolved to its file; the
checkpoint reader dispatches on it (formats/stored.py). Decided by contents (the GGUF magic,
config.json, the quantization metadata), never by file names; nothing but metadata is read."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from leanlm.formats.gguf import is_gguf_file
from leanlm.formats.hf_dir import is_hf_dir
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.registry import resolve_model


class ModelFormat(enum.Enum):
    GGUF = "gguf"  # one file: metadata, tokenizer and (possibly block-quantized) tensors
    HF_DIR = "hf"  # config.json + safetensors (+ tokenizer files)
    LEANLM_CHECKPOINT = (
        "leanlm"  # an HF directory save_checkpoint wrote: quantization_config.json lists its quantized layers
    )
    GPTQ = "gptq"  # an HF directory whose config.json has a GPTQ quantization_config block
    # an HF directory whose config.json has a compressed-tensors quantization_config block (sparse: see
    # formats/compressed_tensors.py)
    COMPRESSED_TENSORS = "compressed-tensors"


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the file or directory (a bundled name resolved to its assembled file)
    format: ModelFormat

    @property
    def is_directory(self) -> bool:
        return self.format is not ModelFormat.GGUF


def inspect(name_or_path: str | Path) -> ModelSource:
    """A bundled name, GGUF file or model directory -> where it is and what it is; a ModelLoadError saying
    what to pass instead otherwise."""
    # json only, no tensors (imported here: the format modules pull in torch and the runtime layers)
    from leanlm.formats.compressed_tensors import read_compressed_tensors_config
    from leanlm.formats.gptq import read_gptq_config
    from leanlm.formats.native import QUANT_CONFIG_FILE

    path = resolve_model(name_or_path)
    if is_hf_dir(path):
        if (path / QUANT_CONFIG_FILE).is_file():  # first: our writer may also have left a config.json block
            return ModelSource(path, ModelFormat.LEANLM_CHECKPOINT)
        try:
            if read_gptq_config(path) is not None:
                return ModelSource(path, ModelFormat.GPTQ)
            if read_compressed_tensors_config(path) is not None:
                return ModelSource(path, ModelFormat.COMPRESSED_TENSORS)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        return ModelSource(path, ModelFormat.HF_DIR)
    if is_gguf_file(path):
        return ModelSource(path, ModelFormat.GGUF)
    if path.is_dir():
        raise ModelLoadError(f"directory {path} has no config.json; pass a Hugging Face model directory or a GGUF file")
    raise ModelLoadError(f"{path} is neither a GGUF file (no 'GGUF' magic) nor a Hugging Face model directory")
