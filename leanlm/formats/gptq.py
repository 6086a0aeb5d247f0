"""The GPTQ checkpoint layout the ecosystem reads (AutoGPTQ / GPTQModel "gptq" format, loaded by HF
transformers and vLLM): per layer `qweight` int32 [K / 8, N] (eight 4-bit codes per int32 along K, lowest
bits first), `qzeros` int32 [G, N / 8] (zero point minus one, packed along N), `scales` fp16 [G, N] and
`g_idx` int32 [K] (each input column's group), plus a `quantization_config` block in config.json. This module
owns the format whole: the conversions between it and our group-wise 4-bit runtime layer, reading and writing.
The on-disk layout lives here, not in model/: the runtime layer never sees qweight / qzeros, only the loader does.
"""

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
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.quantized.numerics import pack_int4, unpack_int4

BITS = 4  # the layout packs 32 / bits codes per int32; we export and import 4-bit
CODES_PER_INT32 = 32 // BITS


def pack_int32_rows(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [R, C] (R a multiple of 8) -> int32 [R / 8, C]: row r's code in bits 4 (r % 8) of row r / 8."""
    r, c = codes.shape
    if r % CODES_PER_INT32:
        raise ValueError(f"{r} rows are not a multiple of {CODES_PER_INT32}")
    v = codes.to(torch.int64).view(r // CODES_PER_INT32, CODES_PER_INT32, c)
    shifts = (torch.arange(CODES_PER_INT32, dtype=torch.int64) * BITS).view(1, -1, 1)
    packed = (v << shifts).sum(dim=1)  # [R/8, C] in 0 .. 2^32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int32_rows: int32 [R / 8, C] -> int64 codes [R, C]."""
    v = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(CODES_PER_INT32, dtype=torch.int64) * BITS).view(1, -1, 1)
    codes = (v.unsqueeze(1) >> shifts) & (2**BITS - 1)  # [R/8, 8, C]
    return codes.reshape(-1, packed.shape[1])


def to_gptq_tensors(layer: IntGroupWeightOnlyLinear) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales / g_idx (+ bias) of one 4-bit layer, in the original column order."""
    if layer.bits != BITS:
        raise ValueError(f"the GPTQ layout holds {BITS}-bit codes; this layer has {layer.bits}")
    k = layer.in_features
    codes = unpack_int4(layer.qweight).to(torch.int64)  # [N, K] stored order
    zeros = torch.round(-layer.mins / layer.scales)  # [N, G]: w = (q - z) * s
    if (zeros < 1).any() or (zeros > 15).any():
        raise ValueError(
            "a group has zero point 0, which the GPTQ format (zero - 1 stored) cannot hold; "
            "quantize with symmetric=True for GPTQ export"
        )
    group_of_stored = torch.arange(k) // layer.group_size  # [K]
    g_idx = group_of_stored
    if layer.perm is not None:
        orig = torch.empty_like(codes).index_copy_(1, layer.perm.cpu(), codes)
        g_idx = torch.empty_like(group_of_stored).index_copy_(0, layer.perm.cpu(), group_of_stored)
        codes = orig
    tensors = {
        "qweight": pack_int32_rows(codes.t().contiguous()),  # [K/8, N]
        "qzeros": pack_int32_rows(zeros.to(torch.int64) - 1).t().contiguous(),  # [G, N/8], packed along N
        "scales": layer.scales.t().contiguous().to(torch.float16),  # [G, N]
        "g_idx": g_idx.to(torch.int32),
    }
    if layer.bias is not None:
        tensors["bias"] = layer.bias.to(torch.float16)
    return tensors


def from_gptq_tensors(tensors: dict[str, torch.Tensor], group_size: int) -> IntGroupWeightOnlyLinear:
    """Our runtime layer from one GPTQ layer's tensors (any g_idx whose groups each hold group_size columns)."""
    qweight, scales = tensors["qweight"], tensors["scales"].float()
    if (
        qweight.dim() != 2
        or qweight.dtype != torch.int32
        or 0 in qweight.shape
        or isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
    ):
        raise ValueError(
            f"GPTQ qweight must be a non-empty int32 matrix and group_size a positive integer, got "
            f"{qweight.dtype} {list(qweight.shape)} and group_size={group_size!r}"
        )
    codes = unpack_int32_rows(qweight).t()  # [N, K]
    n, k = codes.shape
    if k % group_size:
        raise ValueError(f"GPTQ layer of K={k} input columns is not a multiple of group_size={group_size}")
    num_groups = k // group_size
    if scales.shape != (num_groups, n) or tensors["qzeros"].shape != (num_groups, -(-n // CODES_PER_INT32)):
        raise ValueError(
            f"GPTQ scales {list(scales.shape)} / qzeros {list(tensors['qzeros'].shape)} do not match "
            f"[G, N] = [{num_groups}, {n}] / [G, N / {CODES_PER_INT32}]"
        )
    zeros = (unpack_int32_rows(tensors["qzeros"].t().contiguous())[:n] + 1).float()  # [N, G]
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.dtype.is_floating_point:
            raise ValueError(
                f"GPTQ g_idx must hold one integer group per input column ({k}), got {g_idx.dtype} {list(g_idx.shape)}"
            )
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
            raise ValueError(f"GPTQ g_idx holds groups outside [0, {num_groups})")
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        perm = torch.argsort(g_idx.long(), stable=True)  # stored column j = input column perm[j]
        counts = torch.bincount(g_idx.long(), minlength=k // group_size)
        if (counts != group_size).any():
            raise ValueError("g_idx groups do not each hold group_size columns; this GPTQ layout is not supported")
        codes = codes[:, perm]
    s = scales.t().contiguous()  # [N, G]
    return IntGroupWeightOnlyLinear(
        pack_int4(codes), s, -zeros * s, tensors.get("bias"), bits=BITS, group_size=group_size, perm=perm
    )


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


def save_gptq_checkpoint(
    checkpoint: Checkpoint, path: str | Path, damp_percent: float = 0.01, *, overwrite: bool = False
) -> Path:
    """Write the checkpoint's model in the GPTQ layout: every quantized layer must be a 4-bit group-wise layer of
    one group size; float tensors go to float16 (what GPTQ kernels expect). The layout has no place for the
    recipe: it is not written. `path` as save_checkpoint's (overwrite, never the source, renamed into place)."""
    model = require_checkpoint(checkpoint, "save_gptq_checkpoint").model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, IntGroupWeightOnlyLinear)}
    others = [n for n, m in model.named_modules() if isinstance(m, RuntimeLinear) and n not in layers]
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
    desc_act = any(m.perm is not None for m in layers.values())
    block = gptq_config_block(group_sizes.pop(), desc_act, sym=_is_symmetric(layers), damp_percent=damp_percent)
    with staged_output_dir(path, [checkpoint.source], overwrite=overwrite) as staging:
        write_model_dir(checkpoint, staging, state, "lm_head" in layers)
        cfg = json.loads((staging / "config.json").read_text())
        cfg["quantization_config"] = block
        cfg["torch_dtype"] = "float16"
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(path)


def _is_symmetric(layers: dict[str, IntGroupWeightOnlyLinear]) -> bool:
    """True when every group's zero point is the midpoint 2^(bits-1) (symmetric quantization)."""
    return all(bool(torch.all(torch.round(-m.mins / m.scales) == 2 ** (BITS - 1))) for m in layers.values())
