"""Every tensor and runtime layer of a checkpoint against the shape its model config gives its HF name, before
the network is built or any kernel reads a tensor (issue 34: a quantized layer consistent with its own metadata
but not with the config made the native decode loop write past its buffers)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.loading.errors import ModelLoadError

# The HF names of a decoder's tensors: the config decides each one's shape (ModelConfig.tensor_shape).
_LAYER_MODULES = (
    r"self_attn\.(?:q|k|v|o)_proj|self_attn\.(?:q|k)_norm|mlp\.(?:experts\.\d+\.|shared_expert\.)?(?:gate|up|down)_proj"
    r"|mlp\.gate|mlp\.shared_expert_gate|input_layernorm|post_attention_layernorm"
)
_MODEL_TENSOR = re.compile(rf"(?:model\.layers\.(\d+)\.(?:{_LAYER_MODULES})|model\.embed_tokens|model\.norm|lm_head)")


_EXPERT_INDEX = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def check_held_experts(
    config: ModelConfig, names: Iterable[str], source: object, field: str | None = "num_experts"
) -> None:
    """ModelLoadError unless the tensor (or layer) `names` hold experts 0 .. E-1 of the config's E, before anything
    is listed, sized or built per expert: a config.json claiming 1e7 experts over a file of 4 allocated 5 GB."""
    if config.moe is None:
        return
    held = 1 + max((int(m.group(1)) for n in names if (m := _EXPERT_INDEX.match(n))), default=-1)
    if held != config.moe.num_experts:
        raise ModelLoadError(
            f"{source}: {field or 'leanlm_moe.num_experts'} is {config.moe.num_experts}, but the file holds tensors "
            f"of {held} experts per layer; the checkpoint does not match its config: re-export or re-download it"
        )


def check_checkpoint_shapes(
    config: ModelConfig, state_dict: dict[str, torch.Tensor], layers: dict[str, nn.Module], source: object
) -> None:
    """ModelLoadError naming the first tensor or layer whose shape (or layer index) the config does not give.
    Tensors of no decoder module (an exit head, say) are left to the network's own name check."""
    check_held_experts(config, [*state_dict, *(name + "." for name in layers)], source)
    for name, tensor in state_dict.items():
        module, _, kind = name.rpartition(".")
        if not _is_decoder_module(module, config, source):
            continue
        if kind not in ("weight", "bias", "e_score_correction_bias"):  # the last: DeepSeek-V3's router bias
            raise ModelLoadError(
                f"{source}: {name} belongs to no layer the checkpoint describes (a quantized layer's tensor without "
                f"the rest of its layer, or metadata that does not name it); re-quantize or re-download it"
            )
        _check(source, name, tuple(tensor.shape), config.tensor_shape(name), "has shape")
    for name, layer in layers.items():
        _is_decoder_module(name, config, source, required=True)
        features = (getattr(layer, "out_features", None), getattr(layer, "in_features", None))
        _check(source, name, features, config.tensor_shape(name + ".weight"), "is a layer of (out, in) features")
        # One inf or NaN scale poisons every logit downstream; a few KiB per layer to read.
        for tensor_name, tensor in layer.named_buffers():
            if tensor.is_floating_point() and not _is_finite(tensor):
                raise ModelLoadError(
                    f"{source}: {name}.{tensor_name} holds infinite or NaN values; the file is corrupt: re-quantize "
                    f"or re-download it"
                )


def check_declared_layer(config: ModelConfig, name: str, features: tuple, source: object) -> None:
    """Before a quantized layer is built from its tensors: the (out, in) features its metadata or packed tensors
    declare against the config, so that nothing of another size is unpacked or allocated."""
    _is_decoder_module(name, config, source, required=True)
    _check(source, name, features, config.tensor_shape(name + ".weight"), "declares (out, in) features")


def _is_decoder_module(module: str, config: ModelConfig, source: object, required: bool = False) -> bool:
    match = _MODEL_TENSOR.fullmatch(module)
    if match is None:
        if required:
            raise ModelLoadError(f"{source}: quantized layer {module} is not a linear of this model; re-export it")
        return False
    if match.group(1) is not None and int(match.group(1)) >= config.num_hidden_layers:
        raise ModelLoadError(
            f"{source}: {module} is in layer {match.group(1)}, but the config has {config.num_hidden_layers} "
            f"layers; the checkpoint does not match its config: re-export or re-download it"
        )
    return True


def _check(source: object, name: str, got: tuple, want: tuple[int, ...], what: str) -> None:
    if got != want:
        raise ModelLoadError(
            f"{source}: {name} {what} {list(got)}, but the model config gives {list(want)}; the checkpoint does not "
            f"match its config (a wrong or edited file): re-quantize, re-export or re-download it"
        )


def _is_finite(t: torch.Tensor) -> bool:
    """No inf or NaN in `t`; torch.isfinite has no float8 kernel, so an fp8 tensor is read widened (one layer's)."""
    return bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all())
