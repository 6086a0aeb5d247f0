"""Mixture-of-experts models in GGUF, as llama.cpp's convert_hf_to_gguf.py writes them: which architecture and
MoEConfig the metadata describes, and the per-expert HF weights inside each layer's [E, ...] expert tensor."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from leanlm.config import ModelConfig
from leanlm.config.architectures import ARCHITECTURES, by_gguf_name
from leanlm.config.moe import MoEConfig
from leanlm.config.values import check_bool, check_float, to_int
from leanlm.loading.errors import ModelLoadError

# llama.cpp's layout (gguf-py constants.py / tensor_mapping.py; convert_hf_to_gguf.py stacks the HF experts):
#   blk.N.ffn_gate_inp      router [E, hidden]                   -> model.layers.N.mlp.gate
#   blk.N.ffn_{gate,up,down}_exps  one 3-D tensor [E, out, in]   -> model.layers.N.mlp.experts.{e}.{gate,up,down}_proj
#   blk.N.ffn_{gate,up,down}_shexp shared expert (Qwen2-MoE)     -> model.layers.N.mlp.shared_expert.*
#   blk.N.ffn_gate_inp_shexp       its sigmoid gate [hidden]     -> model.layers.N.mlp.shared_expert_gate [1, hidden]
#   blk.N.attn_{q,k}_norm          OLMoE's norms over q and k    -> model.layers.N.self_attn.{q,k}_norm
# Mixtral is `general.architecture = llama` with `llama.expert_count`; its expert width is `llama.feed_forward_length`.
# Early Mixtral files hold one 2-D tensor per expert, blk.N.ffn_{gate,up,down}.E.weight; they load too.

# GGUF name (after "blk.{i}.") -> HF name (after "model.layers.{i}.") of the tensors only MoE layers have
MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# the 3-D tensors: one [E, out, in] per layer and projection
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_RE = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")
# llama.cpp's first Mixtral files (before the 3-D merge, early 2024; llama.cpp still loads them): one 2-D tensor
# per expert, blk.N.ffn_{gate,up,down}.E.weight
_LEGACY_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")

# llama.cpp's graphs (src/models/*.cpp, build_moe_ffn's norm_w argument): Mixtral (llama) renormalises the top-k
# softmax weights; qwen2moe and olmoe do not, whatever the HF config's norm_topk_prob said, unless the file says
# `{arch}.expert_weights_norm` (a key llama.cpp reads for other MoE architectures).
_RENORMALISES = {"llama": True, "qwen2moe": False, "olmoe": False, "qwen3moe": True}

Field = Callable[[str], Any]  # metadata key -> value or None


def moe_architecture(gguf_arch: str, field: Field) -> str:
    """Our architecture name for a GGUF `general.architecture` (ModelLoadError for one we cannot run)."""
    arch = by_gguf_name(gguf_arch)
    if arch is None:
        names = [a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name]
        raise ModelLoadError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(names)} "
            "(a llama file with experts is Mixtral)"
        )
    if gguf_arch == "llama" and to_int(field("llama.expert_count") or 0, "llama.expert_count", minimum=0) > 0:
        return "mixtral"
    return arch.model_type


def gguf_moe_config(gguf_arch: str, field: Field, tensor_names: set[str], num_layers: int) -> MoEConfig | None:
    """The MoEConfig of a GGUF file's metadata and tensor list; None for a dense file."""
    num_experts = to_int(field(f"{gguf_arch}.expert_count") or 0, f"{gguf_arch}.expert_count", minimum=0)
    if not num_experts:
        if gguf_arch in ("qwen2moe", "olmoe", "qwen3moe"):
            raise ModelLoadError(f"GGUF {gguf_arch} file has no {gguf_arch}.expert_count; the file is incomplete")
        return None
    top_k = field(f"{gguf_arch}.expert_used_count")
    if not top_k:  # absent, or 0 as some converters write for "unset"
        raise ModelLoadError(f"GGUF MoE file has no {gguf_arch}.expert_used_count (experts per token); re-convert it")
    top_k = to_int(top_k, f"{gguf_arch}.expert_used_count")
    _check_gating(gguf_arch, field)
    ffn = to_int(field(f"{gguf_arch}.feed_forward_length") or 0, f"{gguf_arch}.feed_forward_length", minimum=0)
    # llama.cpp's widths: llama and olmoe experts are n_ff wide; qwen2moe's say so, else n_ff / k (shared: n_ff)
    fallback = ffn // top_k if gguf_arch == "qwen2moe" else ffn
    key = f"{gguf_arch}.expert_feed_forward_length"
    expert_ffn = to_int(field(key) or fallback, key)
    sparse = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    if not sparse:
        raise ModelLoadError(
            f"GGUF metadata {gguf_arch}.expert_count is {num_experts}, but the file has no blk.N.ffn_gate_inp.weight "
            "router: it holds no experts; re-convert it"
        )
    shared = 0
    if f"blk.{sparse[0]}.ffn_up_shexp.weight" in tensor_names:
        key = f"{gguf_arch}.expert_shared_feed_forward_length"
        shared = to_int(field(key) or ffn, key)
    if shared and gguf_arch == "llama":
        raise ModelLoadError(
            "GGUF llama file with shared experts (Granite-MoE-shared) is not supported; Mixtral files have none"
        )
    norm = field(f"{gguf_arch}.expert_weights_norm")
    renorm = _RENORMALISES[gguf_arch] if norm is None else check_bool(norm, f"{gguf_arch}.expert_weights_norm")
    try:
        return MoEConfig(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=expert_ffn,
            scoring="softmax_renorm" if renorm else "softmax",
            shared_expert_intermediate_size=shared,
            shared_expert_gate=f"blk.{sparse[0]}.ffn_gate_inp_shexp.weight" in tensor_names,
            sparse_layers=None if len(sparse) == num_layers else sparse,
        )
    except ValueError as e:
        raise ModelLoadError(f"GGUF metadata describes an invalid MoE: {e}") from e


def _check_gating(gguf_arch: str, field: Field) -> None:
    """Refuse what our router cannot compute: a sigmoid gate, or weights scaled by a constant."""
    gating = field(f"{gguf_arch}.expert_gating_func")
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX = 1
        raise ModelLoadError(f"GGUF expert gating function {gating} is not supported (only softmax, 1)")
    scale = field(f"{gguf_arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):  # llama.cpp applies it only when != 0 and != 1
        raise ModelLoadError(f"GGUF {gguf_arch}.expert_weights_scale {scale} is not supported (only 1)")


def moe_config_fields(gguf_arch: str, field: Field) -> dict[str, Any]:
    """The ModelConfig field OLMoE's attention adds: clamped q/k/v when the file says so (`{arch}.attention.
    clamp_kqv`; llama.cpp's converter writes it for OLMo, and its OLMoE graph does not clamp)."""
    clip = field(f"{gguf_arch}.attention.clamp_kqv")
    clip = None if clip is None else check_float(clip, f"{gguf_arch}.attention.clamp_kqv", 0.0)
    return {"clip_qkv": clip}


def legacy_expert_name(gguf_name: str) -> str | None:
    """'blk.3.ffn_up.5.weight' (a per-expert tensor of an early Mixtral file) -> its HF name; None for others."""
    match = _LEGACY_EXPERT_RE.fullmatch(gguf_name)
    if match is None:
        return None
    layer, proj, expert = match.groups()
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def is_expert_tensor(gguf_name: str) -> bool:
    return _EXPERT_RE.fullmatch(gguf_name) is not None


def expert_parts(
    gguf_name: str, stored: tuple[int, ...], data: np.ndarray, config: ModelConfig
) -> list[tuple[str, np.ndarray, tuple[int, ...]]]:
    """(HF name, data view, [out, in]) of each expert in a `blk.N.ffn_*_exps.weight` tensor of `stored` shape
    [E, out, in] (outermost first). `data` is the file's view: [E, out, row bytes or in]; nothing is copied."""
    match = _EXPERT_RE.fullmatch(gguf_name)
    layer, kind = int(match.group(1)), EXPERT_TENSORS[match.group(2)]
    if config.moe is None or not config.moe.is_sparse(layer):
        raise ModelLoadError(f"GGUF tensor {gguf_name} holds experts, but its metadata gives layer {layer} none")
    prefix = f"model.layers.{layer}.mlp.experts"
    expected = config.tensor_shape(f"{prefix}.0.{kind}.weight")
    if stored != (config.moe.num_experts, *expected):
        raise ModelLoadError(
            f"GGUF tensor {gguf_name} has shape {list(stored)}, but the metadata describes "
            f"{[config.moe.num_experts, *expected]} ({config.moe.num_experts} experts); the file is corrupt"
        )
    return [(f"{prefix}.{e}.{kind}.weight", data[e], expected) for e in range(config.moe.num_experts)]


def moe_stored_shape(hf_name: str, stored: tuple[int, ...], expected: tuple[int, ...]) -> tuple[int, ...]:
    """Qwen2-MoE's shared-expert gate [1, hidden] is written squeezed, [hidden], by most converters: accept both."""
    if hf_name.endswith(".mlp.shared_expert_gate.weight") and stored == expected[1:]:
        return expected
    return stored
