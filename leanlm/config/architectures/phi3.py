"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's block whose files hold q, k and v as one `qkv_proj` and gate and up as one
`gate_up_proj` (split on read, so every runtime format, compression method and shard sees separate linears, and
fused again on write), LongRoPE scaling (leanlm.config.rope) and a partial rotary dimension (Phi-4-mini: 3/4)."""

from __future__ import annotations

import re
from typing import Any

import torch

from leanlm.config.architectures.spec import Architecture
from leanlm.config.values import check_dict, check_float, optional

_QKV = re.compile(r"(model\.layers\.\d+\.)self_attn\.qkv_proj\.(weight|bias)")
_GATE_UP = re.compile(r"(model\.layers\.\d+\.)mlp\.gate_up_proj\.(weight|bias)")
_PARTS = re.compile(r"(model\.layers\.\d+\.)(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)")


def _split(config, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if m := _QKV.fullmatch(name):
            prefix, kind = m.groups()
            if tensor.shape[0] != q_rows + 2 * kv_rows:
                raise ValueError(f"{name} has {tensor.shape[0]} rows, not q + k + v = {q_rows + 2 * kv_rows}")
            q, k, v = tensor.split((q_rows, kv_rows, kv_rows))
            out |= {f"{prefix}self_attn.{p}_proj.{kind}": t.contiguous() for p, t in zip("qkv", (q, k, v))}
        elif m := _GATE_UP.fullmatch(name):
            prefix, kind = m.groups()
            if tensor.shape[0] != 2 * config.intermediate_size:
                raise ValueError(f"{name} has {tensor.shape[0]} rows, not gate + up = {2 * config.intermediate_size}")
            gate, up = tensor.chunk(2)
            out |= {f"{prefix}mlp.gate_proj.{kind}": gate.contiguous(), f"{prefix}mlp.up_proj.{kind}": up.contiguous()}
        else:
            out[name] = tensor
    return out


def _fuse(config, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        m = _PARTS.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        prefix, module, kind = m.groups()
        fused = "self_attn.qkv_proj" if module.startswith("self_attn") else "mlp.gate_up_proj"
        parts.setdefault((prefix, fused, kind), {})[module] = tensor
    order = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}  # fmt: skip
    for (prefix, fused, kind), held in parts.items():
        out[f"{prefix}{fused}.{kind}"] = torch.cat([held[m] for m in order[fused]])
    return out


def _read(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    params = check_dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}, "rope_parameters")
    factor = check_float(
        optional(params, "partial_rotary_factor", optional(cfg, "partial_rotary_factor", 1.0)),
        "partial_rotary_factor",
        0.0,
        1.0,
    )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"rotary_dim": None if factor == 1.0 else int(head_dim * factor)}


def _write(config) -> dict[str, Any]:
    # HF's Phi3Config pads with 32000 unless told: past the vocabulary of any smaller model
    out: dict[str, Any] = {"pad_token_id": None}
    if config.rotary_dim is not None:
        out["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    if config.rope_scaling is not None:
        out["original_max_position_embeddings"] = config.rope_scaling.original_max_position_embeddings
    return out


def _read_gguf(field, arch: str, num_layers: int, head_dim: int, tensor) -> dict[str, Any]:
    """llama.cpp's Phi-3 files: the rotary width as rope.dimension_count, LongRoPE's factors as the tensors
    rope_factors_short / rope_factors_long with its attention factor and original context in metadata, the window
    on every layer."""
    from leanlm.config.rope import RopeScaling
    from leanlm.config.values import to_int

    # every Phi-3 head is hidden / heads wide; the converter writes the rotary part of it as rope.dimension_count
    head_dim = to_int(field(f"{arch}.embedding_length"), "embedding_length") // to_int(
        field(f"{arch}.attention.head_count"), "attention.head_count"
    )
    out: dict[str, Any] = {"head_dim": head_dim}
    rotary = field(f"{arch}.rope.dimension_count")
    if rotary is not None and to_int(rotary, f"{arch}.rope.dimension_count") != head_dim:
        out["rotary_dim"] = to_int(rotary, f"{arch}.rope.dimension_count")
    short, long = tensor("rope_factors_short.weight"), tensor("rope_factors_long.weight")
    if short is not None and long is not None:
        original = to_int(field(f"{arch}.rope.scaling.original_context_length") or 4096, "original_context_length")
        attention = field(f"{arch}.rope.scaling.attn_factor")
        context = to_int(field(f"{arch}.context_length"), f"{arch}.context_length")
        out["rope_scaling"] = RopeScaling(
            rope_type="longrope",
            factor=context / original,
            original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in short),
            long_factor=tuple(float(f) for f in long),
            attention_factor=None if attention is None else check_float(attention, "rope.scaling.attn_factor", 0.0),
        )
    window = field(f"{arch}.attention.sliding_window")
    if window:
        out["layer_windows"] = (to_int(window, f"{arch}.attention.sliding_window"),) * num_layers
    return out


PHI3 = Architecture(
    "phi3",
    "Phi3ForCausalLM",
    gguf_name="phi3",
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    read_gguf=_read_gguf,
    window_every_layer=True,
    read_config=_read,
    write_config=_write,
    to_model_names=_split,
    to_file_names=_fuse,
)
