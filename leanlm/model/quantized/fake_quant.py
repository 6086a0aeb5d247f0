"""A trainable stand-in for an integer weight-only layer (QAT, and ZeroQuant's LKD): the weight in float with its
per-group scale and offset, rounded onto the grid in the forward with a straight-through estimator, and converted
back to the layer's runtime format after training."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.quantized.numerics import pack_int4

TRAINABLE = (Int8WeightOnlyLinear, IntGroupWeightOnlyLinear)


# Scales and offsets learn at this fraction of the weights' learning rate (read by the trainer's optimizer groups,
# `lr_scale` on a parameter): Adam moves every parameter by about the learning rate whatever its gradient, and a
# scale is a few times smaller than the weights it covers, so at the weights' rate it would swing the whole grid.
GRID_LR_SCALE = 0.1


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


class FakeQuantLinear(nn.Module):
    """A trainable stand-in for an int8 or 2-4 bit weight-only layer: w_q = clamp(round((w - off) / s)) * s + off
    per group, with w, s and off parameters (off is 0 for the symmetric int8 grid)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if isinstance(layer, IntGroupWeightOnlyLinear):
            if layer.perm is not None:
                raise ValueError(
                    "QAT and LKD train layers stored in input order: quantize without act-order, or with GPTQ's "
                    "static groups (--static-groups)"
                )
            self.lo, self.hi, group = 0, 2**layer.bits - 1, layer.group_size
            offset = layer.mins
        else:  # Int8WeightOnlyLinear: symmetric codes, one scale per channel or group
            self.lo, self.hi, group = -127, 127, layer.group_size or layer.in_features
            offset = None
        self._source, self.group = (layer,), group  # a tuple: not a submodule, so not in state_dict
        scales = layer.scales.reshape(layer.out_features, -1)  # [N, G]
        self.weight = nn.Parameter(layer.dequantized_weight().float())  # [N, K]
        self.scale = nn.Parameter(scales.float().clone())
        self.offset = None if offset is None else nn.Parameter(offset.float().clone())
        for grid in (self.scale, self.offset):
            if grid is not None:
                grid.lr_scale = GRID_LR_SCALE
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().float())

    @property
    def source(self) -> nn.Module:
        """The layer this stands in for, as it was."""
        return self._source[0]

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-column scale and offset [N, K]."""
        scale = self.scale.repeat_interleave(self.group, dim=1)
        offset = torch.zeros_like(scale) if self.offset is None else self.offset.repeat_interleave(self.group, dim=1)
        return scale, offset

    def codes(self, ste: bool) -> torch.Tensor:
        scale, offset = self._grid()
        q = (self.weight - offset) / scale
        return (_round_ste(q) if ste else torch.round(q)).clamp(self.lo, self.hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, offset = self._grid()
        return F.linear(x, self.codes(ste=True) * scale + offset, self.bias)

    @torch.no_grad()
    def to_module(self) -> nn.Module:
        """The source layer's format with the trained codes, scales and offsets."""
        src, codes = self.source, self.codes(ste=False)
        bias = self.bias
        if isinstance(src, IntGroupWeightOnlyLinear):
            return IntGroupWeightOnlyLinear(
                pack_int4(codes.to(torch.int16)),
                self.scale.detach(),
                self.offset.detach(),
                bias,
                bits=src.bits,
                group_size=src.group_size,
            )
        scales = self.scale.detach() if src.group_size is not None else self.scale.detach().reshape(-1)
        return Int8WeightOnlyLinear(codes.to(torch.int8), scales, bias, group_size=src.group_size)


def _swap(root: nn.Module, kinds: tuple[type, ...], make) -> list[nn.Module]:
    """Replace every submodule of root whose type is one of kinds by make(it); the replacements, in order."""
    made = []
    for name, module in list(root.named_modules()):
        if type(module) in kinds:
            parent_name, _, attr = name.rpartition(".")
            made.append(make(module))
            setattr(root.get_submodule(parent_name), attr, made[-1])
    return made


def attach_fake_quant(root: nn.Module) -> list[FakeQuantLinear]:
    """Replace every int8 / 2-4 bit weight-only linear under root by its trainable stand-in."""
    return _swap(root, TRAINABLE, FakeQuantLinear)


def detach_fake_quant(root: nn.Module, trained: bool = True) -> int:
    """Put back runtime layers: with the trained codes, scales and offsets, or (trained=False) the layers the
    stand-ins were made from. How many were put back."""
    return len(_swap(root, (FakeQuantLinear,), lambda s: s.to_module() if trained else s.source))
