"""The GPTQ checkpoint layout the ecosystem reads (AutoGPTQ / GPTQModel "gptq" format, loaded by HF
transformers and vLLM): per layer `qweight` int32 [K / 8, N] (eight 4-bit codes per int32 along K, lowest
bits first), `qzeros` int32 [G, N / 8] (zero point minus one, packed along N), `scales` fp16 [G, N] and
`g_idx` int32 [K] (each input column's group), plus a `quantization_config` block in config.json.

Writing it: model/quantized/gptq_layout.py converts the layers, loading/quantized.py reads such checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leanlm.compress.checkpoint import float_tensors, write_model_dir
from leanlm.model.quantized.gptq_layout import BITS, to_gptq_tensors
from leanlm.model.quantized.linear import IntGroupWeightOnlyLinear, QuantLinear


def gptq_config_block(group_size: int, desc_act: bool, sym: bool, damp_percent: float) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": damp_percent,
        "true_sequential": False,
        "checkpoint_format": "gptq",
    }


def save_gptq_checkpoint(model: nn.Module, path: str | Path, tokenizer=None, damp_percent: float = 0.01) -> Path:
    """Write `model` in the GPTQ layout: every quantized layer must be a 4-bit group-wise layer of one group
    size; float tensors go to float16 (what GPTQ kernels expect)."""
    path = Path(path)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, IntGroupWeightOnlyLinear)}
    others = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and n not in layers]
    if not layers or others:
        raise ValueError(
            "GPTQ export needs a model whose quantized layers are all 4-bit group-wise "
            f"(found {len(layers)} such layers and {len(others)} of other formats)"
        )
    group_sizes = {m.group_size for m in layers.values()}
    if len(group_sizes) != 1 or any(m.bits != BITS for m in layers.values()):
        raise ValueError(f"GPTQ export needs one group size and {BITS}-bit codes; found groups {sorted(group_sizes)}")
    state = float_tensors(model, layers, torch.float16)
    for name, layer in layers.items():
        state.update({f"{name}.{k}": v for k, v in to_gptq_tensors(layer.cpu()).items()})
    write_model_dir(model, path, state, "lm_head" in layers, tokenizer)
    cfg = json.loads((path / "config.json").read_text())
    desc_act = any(m.perm is not None for m in layers.values())
    cfg["quantization_config"] = gptq_config_block(
        group_sizes.pop(), desc_act, sym=_is_symmetric(layers), damp_percent=damp_percent
    )
    cfg["torch_dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def _is_symmetric(layers: dict[str, IntGroupWeightOnlyLinear]) -> bool:
    """True when every group's zero point is the midpoint 2^(bits-1) (symmetric quantization)."""
    return all(bool(torch.all(torch.round(-m.mins / m.scales) == 2 ** (BITS - 1))) for m in layers.values())
