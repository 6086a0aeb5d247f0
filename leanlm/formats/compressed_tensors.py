"""Sparse checkpoints in the compressed-tensors layout (what llm-compressor writes; HF transformers and vLLM
read it through the compressed-tensors package, up to its 0.12 releases, after which the sparse formats are
"legacy" and have no compressor): the float tensors as usual, each sparse weight as the tensors of
model/linear/bitmask_layout.py, and a `quantization_config` block in config.json holding only a `sparsity_config`.

Writing: 2:4 layers (Sparse24Linear) as "sparse-24-bitmask", unstructured ones (BitmaskSparseLinear, or pruned float
linears) as "sparse-bitmask". Reading: 2:4 weights become Sparse24Linear layers as they are stored, unstructured ones
BitmaskSparseLinear layers where sparse enough for its kernel to pay (bitmask.MIN_SPARSITY) and K is a multiple of 8,
else dense float weights with their zeros. Quantized compressed-tensors checkpoints (config groups) are refused with
what to do instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.formats.checkpoint import Checkpoint, require_checkpoint
from leanlm.formats.model_dir import float_tensors, write_model_dir
from leanlm.formats.output_dir import staged_output_dir
from leanlm.loading.shapes import check_declared_layer
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.bitmask_layout import (
    bitmask_layer_tensors,
    bitmask_tensors,
    from_bitmask_layer_tensors,
    from_bitmask_tensors,
    from_sparse24_tensors,
    sparse24_tensors,
)
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.sparsity_mask import pruned_mask

SPARSE_FORMATS = ("sparse-24-bitmask", "sparse-bitmask")
CT_VERSION = "0.12.2"  # the compressed-tensors release whose decompressors this layout was checked against


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


def save_compressed_tensors_checkpoint(
    checkpoint: Checkpoint, path: str | Path, dtype: torch.dtype = torch.bfloat16, *, overwrite: bool = False
) -> Path:
    """Write a pruned model (2:4 or unstructured, float otherwise) in the compressed-tensors layout; the layout
    has no place for the recipe: it is not written. `path` as save_checkpoint's (overwrite, never the source,
    renamed into place)."""
    model = require_checkpoint(checkpoint, "save_compressed_tensors_checkpoint").model
    packed = {n: m for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}
    unstructured = {n: m for n, m in model.named_modules() if isinstance(m, BitmaskSparseLinear)}
    others = [n for n, m in model.named_modules() if isinstance(m, RuntimeLinear) and n not in packed | unstructured]
    if others:
        raise ValueError(
            f"compressed-tensors export here writes sparse float models; {others[0]} is quantized "
            "(write it with the leanlm format, or export 4-bit weights with `leanlm quantize --format gptq`)"
        )
    pruned = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and pruned_mask(m) is not None}
    pruned.update(unstructured)
    if packed and pruned:
        raise ValueError(
            "a compressed-tensors checkpoint holds one sparsity format: this model has 2:4 and other pruned linears"
        )
    if not packed and not pruned:
        raise ValueError("nothing to export as compressed-tensors: the model has no pruned linear (run leanlm prune)")
    targets = packed or pruned
    state = float_tensors(model, targets, dtype)
    zeros = total = 0
    for name, module in targets.items():
        if isinstance(module, Sparse24Linear):
            tensors, weight = sparse24_tensors(module), module.dequantized_weight()
        elif isinstance(module, BitmaskSparseLinear):
            weight = module.dequantized_weight()
            tensors = {**bitmask_layer_tensors(module), "compressed": module.values.to(dtype)}
        else:
            weight = module.weight.detach().to(dtype)
            tensors = bitmask_tensors(weight)
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().to(dtype)
        zeros, total = zeros + int((weight == 0).sum()), total + weight.numel()
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, RuntimeLinear))]
    block = {
        "quant_method": "compressed-tensors",
        "version": CT_VERSION,
        "sparsity_config": {
            "format": "sparse-24-bitmask" if packed else "sparse-bitmask",
            "sparsity_structure": "2:4" if packed else "unstructured",
            "global_sparsity": zeros / total,
            "targets": ["Linear"],
            "ignore": sorted(n for n in linears if n not in targets),
            "registry_requires_subclass": False,
        },
    }
    with staged_output_dir(path, [checkpoint.source], overwrite=overwrite) as staging:
        write_model_dir(checkpoint, staging, state, False)
        cfg = json.loads((staging / "config.json").read_text())
        cfg["quantization_config"] = block
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(path)
