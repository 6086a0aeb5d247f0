"""LeanLM's own checkpoint format, read and written: an HF directory (safetensors, config.json, tokenizer) plus
`quantization_config.json`, which lists each quantized layer with its saved `format` (that decides its runtime
class, never its name) and the recipe that made the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from leanlm.config import ModelConfig
from leanlm.formats.checkpoint import Checkpoint, require_checkpoint
from leanlm.formats.model_dir import float_tensors, write_model_dir
from leanlm.formats.output_dir import staged_output_dir
from leanlm.loading.shapes import check_declared_layer
from leanlm.model.linear.base import LINEAR_FORMATS, RuntimeLinear

QUANT_CONFIG_FILE = "quantization_config.json"
FORMAT_VERSION = 1


def read_quantization_config(path: Path) -> dict[str, Any] | None:
    """The parsed quantization_config.json of a model directory, or None when it has none."""
    file = path / QUANT_CONFIG_FILE
    if not file.is_file():
        return None
    meta = json.loads(file.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{file} is not a JSON object; re-quantize the model or restore the file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{file} has format_version {meta.get('format_version')}; this leanlm reads "
            f"{FORMAT_VERSION}: re-quantize the model with this version"
        )
    return meta


def quantized_layers(
    meta: dict[str, Any], state_dict: dict[str, torch.Tensor], config: ModelConfig, source: object = ""
) -> dict[str, RuntimeLinear]:
    """Build each quantized layer named in `meta` from its tensors, removing them from `state_dict`; a layer whose
    declared features are not what `config` gives its name is a ModelLoadError before any tensor is read."""
    layers = {}
    if not isinstance(meta.get("layers"), dict):
        raise ValueError(f"{QUANT_CONFIG_FILE} has no 'layers' object")
    for name, layer_meta in meta["layers"].items():
        fmt = layer_meta.get("format") if isinstance(layer_meta, dict) else None
        if fmt not in LINEAR_FORMATS:
            raise ValueError(
                f"layer {name} has quantized format {fmt!r}, unknown to this leanlm "
                f"(known: {', '.join(LINEAR_FORMATS)})"
            )
        check_declared_layer(config, name, (layer_meta.get("out_features"), layer_meta.get("in_features")), source)
        prefix = name + "."
        tensors = {k[len(prefix) :]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        # Shapes, group sizes and index ranges are checked against the metadata here, before any kernel runs.
        try:
            layers[name] = LINEAR_FORMATS[fmt].from_tensors(layer_meta, tensors)
        except (ValueError, TypeError) as e:  # TypeError: metadata keys or values of the wrong kind
            raise ValueError(f"layer {name}: {e}") from e
    return layers


def save_checkpoint(
    checkpoint: Checkpoint,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    overwrite: bool = False,
    keep_files: tuple[str, ...] = (),
) -> Path:
    """Write the checkpoint (compressed or not) as an HF-style directory that `LLM(path)` / `--model path` loads.

    Float tensors are stored in `dtype`; quantized layers keep their codes and float32 scales as they are. A
    non-empty `path` is replaced only with overwrite=True, never when it is (or holds, or is inside) the
    checkpoint's source; the files are written beside it and renamed into place (formats/output_dir.py).
    `keep_files`: files of the directory being replaced that move into the new one (a training run's state)."""
    checkpoint = require_checkpoint(checkpoint, "save_checkpoint")
    model = checkpoint.model
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, RuntimeLinear)}
    state = float_tensors(model, quantized, dtype)
    for name, layer in quantized.items():
        for key, tensor in layer.state_dict().items():
            state[f"{name}.{key}"] = tensor.to(dtype) if key in layer.compute_dtype_buffers else tensor
    meta = {
        "format_version": FORMAT_VERSION,
        "recipe": list(checkpoint.recipe),
        "layers": {name: m.metadata() for name, m in quantized.items()},
    }
    with staged_output_dir(path, [checkpoint.source], overwrite=overwrite, keep_files=keep_files) as staging:
        write_model_dir(checkpoint, staging, state, "lm_head" in quantized)
        (staging / QUANT_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    return Path(path)
