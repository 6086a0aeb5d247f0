"""Reading quantized model directories: LeanLM's own (`quantization_config.json`: the saved `format` of each
layer decides its runtime class, never its name) and GPTQ's (config.json's `quantization_config` block).
compress/checkpoint.py and compress/gptq_format.py write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.loading.shapes import check_declared_layer
from leanlm.model.quantized.gptq_layout import BITS, CODES_PER_INT32, from_gptq_tensors
from leanlm.model.quantized.linear import QUANT_LINEAR_FORMATS, QuantLinear
from leanlm.model.sparse import semi_structured  # noqa: F401  (registers "sparse24", "act_sparse", "sparse_bitmask")

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
) -> dict[str, QuantLinear]:
    """Build each quantized layer named in `meta` from its tensors, removing them from `state_dict`; a layer whose
    declared features are not what `config` gives its name is a ModelLoadError before any tensor is read."""
    layers = {}
    if not isinstance(meta.get("layers"), dict):
        raise ValueError(f"{QUANT_CONFIG_FILE} has no 'layers' object")
    for name, layer_meta in meta["layers"].items():
        fmt = layer_meta.get("format") if isinstance(layer_meta, dict) else None
        if fmt not in QUANT_LINEAR_FORMATS:
            raise ValueError(
                f"layer {name} has quantized format {fmt!r}, unknown to this leanlm "
                f"(known: {', '.join(QUANT_LINEAR_FORMATS)})"
            )
        check_declared_layer(config, name, (layer_meta.get("out_features"), layer_meta.get("in_features")), source)
        prefix = name + "."
        tensors = {k[len(prefix) :]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        # Shapes, group sizes and index ranges are checked against the metadata here, before any kernel runs.
        try:
            layers[name] = QUANT_LINEAR_FORMATS[fmt].from_tensors(layer_meta, tensors)
        except (ValueError, TypeError) as e:  # TypeError: metadata keys or values of the wrong kind
            raise ValueError(f"layer {name}: {e}") from e
    return layers


def read_gptq_config(path: Path) -> dict[str, Any] | None:
    """config.json's quantization_config when it describes a GPTQ checkpoint we can load, else None."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    block = json.loads(config_file.read_text()).get("quantization_config")
    if not block or block.get("quant_method") != "gptq":
        return None
    if block.get("bits") != BITS:
        raise ValueError(
            f"{config_file}: GPTQ checkpoints of {block.get('bits')} bits are not supported; "
            f"leanlm loads {BITS}-bit GPTQ"
        )
    if block.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(
            f"{config_file}: GPTQ checkpoint_format {block['checkpoint_format']!r} is not supported; "
            "leanlm reads the standard 'gptq' format"
        )
    return block


def gptq_layers(
    block: dict[str, Any], state_dict: dict[str, torch.Tensor], config: ModelConfig, source: object = ""
) -> dict[str, nn.Module]:
    """Every GPTQ layer of a state dict as our runtime layer, removing its tensors from `state_dict`. Its qweight
    [K / 8, N] must hold the (N, K) `config` gives its name (a ModelLoadError before it is unpacked)."""
    group_size = block.get("group_size")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"GPTQ group_size {group_size!r} must be an integer (-1: one group per row)")
    layers = {}
    for name in [k.removesuffix(".qweight") for k in state_dict if k.endswith(".qweight")]:
        prefix = name + "."
        tensors = {k[len(prefix) :]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        qweight = tensors["qweight"]
        if qweight.dim() != 2:
            raise ValueError(f"layer {name}: GPTQ qweight has shape {list(qweight.shape)}; expected [K / 8, N]")
        in_features = qweight.shape[0] * CODES_PER_INT32
        check_declared_layer(config, name, (qweight.shape[1], in_features), source)
        missing = [t for t in ("qzeros", "scales") if t not in tensors]
        if missing:
            raise ValueError(f"layer {name}: the GPTQ layer lacks tensors {missing}")
        try:
            layers[name] = from_gptq_tensors(tensors, group_size if group_size > 0 else in_features)
        except ValueError as e:
            raise ValueError(f"layer {name}: {e}") from e
    return layers
