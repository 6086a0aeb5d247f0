"""Building a network at a rank's size: the whole model on the meta device (no memory), cut to the rank's shape by
the caller (tensor shards, a pipeline stage), then only the tensors the cut network holds are put in place, from a
checkpoint read already cut to it. No whole-model tensor is ever allocated."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.model.layers import RotaryEmbedding
from leanlm.model.llama import CheckpointMismatchError, LlamaForCausalLM

# (the meta network) -> the map from its module names to the checkpoint's (HF) module names
Arrange = Callable[[LlamaForCausalLM], Callable[[str], str]]


def build_cut_model(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str,
    quantized: Mapping[str, nn.Module],
    arrange: Arrange,
) -> LlamaForCausalLM:
    """The network of `config` cut by `arrange` (which edits the meta network in place and says where each of its
    modules comes from in the checkpoint), holding `state_dict`'s float tensors (HF names, already cut to the
    shapes `arrange` gave) and the prebuilt `quantized` layers (by HF module name, cut alike)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend)
    checkpoint_name = arrange(model)
    place = {checkpoint_name(name): name for name, _ in model.named_modules()}  # a wrapped linear: its inner one
    for hf_module, layer in quantized.items():
        target = place.get(hf_module)
        if target is None:
            raise CheckpointMismatchError(f"the checkpoint's layer {hf_module} has no place in this rank's network")
        _check_same_shape(hf_module, model.get_submodule(target), layer)
        model.set_submodule(target, layer.to(device).set_compute_dtype(dtype))
    adopted: dict[tuple[str, str], torch.Tensor] = {}  # a tied head shares the embedding's one Parameter
    for module_name, module in model.named_modules(remove_duplicate=False):
        source = checkpoint_name(module_name)
        for kind in ("_parameters", "_buffers"):
            for leaf, t in list(getattr(module, kind).items()):
                if t is None or not t.is_meta:
                    continue
                name = _source_name(f"{source}.{leaf}" if source else leaf, config)
                if (kind, name) not in adopted:
                    value = _adopt(name, state_dict, t, dtype, device)
                    adopted[kind, name] = nn.Parameter(value, requires_grad=False) if kind == "_parameters" else value
                getattr(module, kind)[leaf] = adopted[kind, name]
    model.rotary_emb = RotaryEmbedding(
        config.rope_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, config.rope_local_theta
    ).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointMismatchError(f"this rank's network has tensors the checkpoint did not fill: {left[:5]}")
    return model.eval().requires_grad_(False)


def _source_name(name: str, config: ModelConfig) -> str:
    """A tied head reads the embedding's tensor (its rows are the head's rows on every rank)."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings and name == "lm_head.weight" else name


def _adopt(
    name: str, state_dict: Mapping[str, torch.Tensor], placeholder: torch.Tensor, dtype: torch.dtype, device
) -> torch.Tensor:
    tensor = state_dict.get(name)
    if tensor is None:
        raise CheckpointMismatchError(f"the checkpoint holds no {name}, which this rank's network needs")
    if tuple(tensor.shape) != tuple(placeholder.shape):
        raise CheckpointMismatchError(
            f"{name} was read as {list(tensor.shape)}, but this rank's network holds {list(placeholder.shape)}"
        )
    return tensor.to(device=device, dtype=dtype) if tensor.is_floating_point() else tensor.to(device)


def _check_same_shape(name: str, placeholder: nn.Module, layer: nn.Module) -> None:
    want = (getattr(placeholder, "out_features", None), getattr(placeholder, "in_features", None))
    got = (getattr(layer, "out_features", None), getattr(layer, "in_features", None))
    if want != got:
        raise CheckpointMismatchError(
            f"the checkpoint's {name} is [{got[0]}, {got[1]}], this rank's network holds [{want[0]}, {want[1]}]"
        )
