"""Reading sparse compressed-tensors checkpoints (llm-compressor's "sparse-24-bitmask" and "sparse-bitmask"
formats, see model/sparse/bitmask_layout.py): 2:4 weights become Sparse24Linear layers as they are stored,
unstructured ones BitmaskSparseLinear layers as they are stored where sparse enough for its kernel to pay
(bitmask.MIN_SPARSITY) and K is a multiple of 8, else dense float weights with their zeros. Quantized
compressed-tensors checkpoints (config groups) are refused with what to do instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.loading.shapes import check_declared_layer
from leanlm.model.sparse.bitmask_layout import from_bitmask_layer_tensors, from_bitmask_tensors, from_sparse24_tensors

SPARSE_FORMATS = ("sparse-24-bitmask", "sparse-bitmask")


def read_compressed_tensors_config(path: Path) -> dict[str, Any] | None:
    """config.json's sparsity_config when the directory is a sparse compressed-tensors checkpoint, else None."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    block = json.loads(config_file.read_text()).get("quantization_config") or {}
    if block.get("quant_method") != "compressed-tensors":
        return None
    if block.get("config_groups"):
        raise ValueError(
            f"{config_file}: a quantized compressed-tensors checkpoint; leanlm reads the sparse ones (sparsity_config "
            "only). Load the float model and quantize it with `leanlm quantize`"
        )
    sparsity = block.get("sparsity_config") or {}
    if sparsity.get("format") not in SPARSE_FORMATS:
        raise ValueError(
            f"{config_file}: compressed-tensors sparsity format {sparsity.get('format')!r} is not supported "
            f"(leanlm reads {', '.join(SPARSE_FORMATS)})"
        )
    return sparsity


def compressed_tensors_layers(
    sparsity: dict[str, Any], state_dict: dict[str, torch.Tensor], config: ModelConfig, source: object = ""
) -> dict[str, nn.Module]:
    """Sparse layers by module name (their tensors, bias included, removed from `state_dict`); unstructured weights
    that stay dense are put back into `state_dict` as `name.weight`. Each weight's stored `shape` must be what
    `config` gives its name: a ModelLoadError before anything of that size is built."""
    layers = {}
    for name in [k.removesuffix(".compressed") for k in state_dict if k.endswith(".compressed")]:
        prefix = name + "."
        suffixes = ("compressed", "bitmask", "shape", "row_offsets")
        tensors = {s: state_dict.pop(prefix + s) for s in suffixes if prefix + s in state_dict}
        declared = tensors.get("shape")
        if declared is not None:  # its absence is reported by the layout's own check below
            if declared.dtype.is_floating_point or declared.dtype.is_complex or declared.numel() != 2:
                raise ValueError(f"layer {name}: compressed-tensors shape {declared.tolist()} is not two integers")
            check_declared_layer(config, name, tuple(int(v) for v in declared.reshape(-1)), source)
        try:
            if sparsity["format"] == "sparse-24-bitmask":
                layers[name] = from_sparse24_tensors(tensors, state_dict.pop(prefix + "bias", None))
            elif (layer := from_bitmask_layer_tensors(tensors, state_dict.get(prefix + "bias"))) is not None:
                layers[name] = layer
                state_dict.pop(prefix + "bias", None)
            else:
                state_dict[prefix + "weight"] = from_bitmask_tensors(tensors)
        except (ValueError, KeyError) as e:
            raise ValueError(f"layer {name}: {e}") from e
    return layers
