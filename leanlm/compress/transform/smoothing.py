"""Per-channel scale folding along a layer's declared `linear_groups`: y = producer(x) / s feeding W * s
leaves the function unchanged (SmoothQuant and AWQ both move difficulty this way)."""

from __future__ import annotations

import torch
from torch import nn


def set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace a parameter with a new tensor (never in place: a model built from a checkpoint may share its
    tensors with the checkpoint's state dict)."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.to(old.dtype), requires_grad=False))


def fold_scales(layer: nn.Module, producer: str, linears: tuple[str, ...], scales: torch.Tensor) -> None:
    """Divide the producer's output channels by `scales` [K] and multiply the linears' input columns by it."""
    prod = layer.get_submodule(producer)
    s = scales.double()
    if prod.weight.dim() == 1:  # a norm: its per-channel gain, offset + weight (Gemma's offset 1)
        offset = getattr(prod, "offset", 0.0)
        set_tensor(prod, "weight", (offset + prod.weight.double()) / s - offset)
    else:  # a linear: its output rows (and bias)
        set_tensor(prod, "weight", prod.weight.double() / s[:, None])
        if getattr(prod, "bias", None) is not None:
            set_tensor(prod, "bias", prod.bias.double() / s)
    for name in linears:
        lin = layer.get_submodule(name)
        set_tensor(lin, "weight", lin.weight.double() * s[None, :])


def weight_absmax(layer: nn.Module, linears: tuple[str, ...]) -> torch.Tensor:
    """max |W[:, j]| over all rows of all the group's linears -> [K]."""
    return torch.stack([layer.get_submodule(n).weight.abs().amax(dim=0).float() for n in linears]).amax(dim=0)


def foldable_groups(layer: nn.Module):
    """The layer's groups whose scales can be folded, all of them plain (unquantized) linears."""
    for group in layer.linear_groups:
        mods = [layer.get_submodule(n) for n in (group.producer, *group.linears)]
        if group.can_fold and all(isinstance(m, nn.Linear) or m.weight.dim() == 1 for m in mods):
            yield group
