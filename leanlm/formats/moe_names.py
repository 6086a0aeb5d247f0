"""HF tensor names of MoE checkpoints to and from the names the model uses (Qwen2-MoE's, HF's per-expert layout):
Mixtral files name experts `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down) and the router
`block_sparse_moe.gate`; transformers 5 may write every expert of a layer fused, `mlp.experts.gate_up_proj`
[E, 2I, hidden] and `mlp.experts.down_proj` [E, hidden, I]."""

from __future__ import annotations

import re

import torch

from leanlm.config import ModelConfig

_MIXTRAL_EXPERT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.(\w+)")
_MIXTRAL_GATE = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.gate\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")
_OURS = re.compile(r"(model\.layers\.\d+\.)mlp\.(experts\.(\d+)\.(gate|up|down)_proj\.(\w+)|gate\.weight)")
_W_TO_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}
_PROJ_TO_W = {v: k for k, v in _W_TO_PROJ.items()}


def to_model_names(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with Mixtral's and fused experts' names (and tensors) in the model's per-expert layout, and the
    tensors its architecture's files fuse (Phi-3's qkv_proj) apart."""
    if config.arch.to_model_names is not None:
        state_dict = config.arch.to_model_names(config, state_dict)
    if config.moe is None:
        return state_dict
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if m := _MIXTRAL_EXPERT.fullmatch(name):
            prefix, e, w, kind = m.groups()
            out[f"{prefix}mlp.experts.{e}.{_W_TO_PROJ[w]}_proj.{kind}"] = tensor
        elif m := _MIXTRAL_GATE.fullmatch(name):
            out[f"{m.group(1)}mlp.gate.weight"] = tensor
        elif (m := _FUSED.fullmatch(name)) and tensor.dim() == 3:
            out |= _split_fused(m.group(1), m.group(2), tensor, config)
        else:
            out[name] = tensor
    return out


def _split_fused(prefix: str, kind: str, tensor: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One fused [E, ...] tensor as E per-expert weights."""
    width = config.moe.expert_intermediate_size
    if kind == "down_proj":
        return {f"{prefix}{e}.down_proj.weight": tensor[e].contiguous() for e in range(tensor.shape[0])}
    if tensor.shape[1] != 2 * width:
        raise ValueError(f"{prefix}{kind} has {tensor.shape[1]} rows per expert, not 2 x {width} (gate then up)")
    out = {}
    for e in range(tensor.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :width].contiguous()
        out[f"{prefix}{e}.up_proj.weight"] = tensor[e, width:].contiguous()
    return out


def to_file_names(config: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's names as the files of `config.architecture` spell them (Mixtral's w1/w3/w2, Phi-3's fused
    projections; others as they are)."""
    if config.arch.to_file_names is not None:
        return config.arch.to_file_names(config, state_dict)
    if config.architecture != "mixtral":
        return state_dict
    out = {}
    for name, tensor in state_dict.items():
        m = _OURS.fullmatch(name)
        if m is None:
            out[name] = tensor
        elif m.group(3) is None:
            out[f"{m.group(1)}block_sparse_moe.gate.weight"] = tensor
        else:
            out[f"{m.group(1)}block_sparse_moe.experts.{m.group(3)}.{_PROJ_TO_W[m.group(4)]}.{m.group(5)}"] = tensor
    return out
