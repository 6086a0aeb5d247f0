"""Sparse checkpoints in the compressed-tensors layout (what llm-compressor writes; HF transformers and vLLM
read it through the compressed-tensors package, up to its 0.12 releases, after which the sparse formats are
"legacy" and have no compressor): the float tensors as usual, each sparse weight as the tensors of
model/sparse/bitmask_layout.py, and a `quantization_config` block in config.json holding only a
`sparsity_config`. 2:4 layers (Sparse24Linear) are written as "sparse-24-bitmask", unstructured ones
(BitmaskSparseLinear, or pruned float linears) as "sparse-bitmask"; loading/quantized.py reads both back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from leanlm.compress.checkpoint import float_tensors, write_model_dir
from leanlm.compress.pruner import pruned_mask
from leanlm.model.quantized.linear import QuantLinear
from leanlm.model.sparse.bitmask import BitmaskSparseLinear
from leanlm.model.sparse.bitmask_layout import bitmask_layer_tensors, bitmask_tensors, sparse24_tensors
from leanlm.model.sparse.semi_structured import Sparse24Linear

CT_VERSION = "0.12.2"  # the compressed-tensors release whose decompressors this layout was checked against


def save_compressed_tensors_checkpoint(
    model: nn.Module, path: str | Path, tokenizer=None, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write a pruned `model` (2:4 or unstructured, float otherwise) in the compressed-tensors layout."""
    path = Path(path)
    packed = {n: m for n, m in model.named_modules() if isinstance(m, Sparse24Linear)}
    unstructured = {n: m for n, m in model.named_modules() if isinstance(m, BitmaskSparseLinear)}
    others = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and n not in packed | unstructured]
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
    write_model_dir(model, path, state, False, tokenizer)
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))]
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
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
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
