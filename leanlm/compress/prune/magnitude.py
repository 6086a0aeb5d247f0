"""Magnitude pruning: zero the weights of smallest |w|, per output row, per layer, or with one threshold over
every pruned linear of the model (global); or keep the n largest of every m (N:M). No data needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import MethodConfig, register_method
from leanlm.compress.prune.owl import LayerProfile
from leanlm.compress.prune.pruner import Pruner
from leanlm.compress.prune.sparsity import SparsityScheme, scheme_mask

SCOPES = ("row", "layer", "global")


@dataclass(frozen=True)
class MagnitudeConfig(MethodConfig, SparsityScheme, LayerProfile):
    # Where the unstructured fraction holds: each output row, each linear, or the model as a whole (then
    # linears with larger weights keep more of them). N:M patterns hold per group of m whatever the scope.
    scope: str = "layer"

    name = "magnitude"

    def __post_init__(self) -> None:
        SparsityScheme.__post_init__(self)
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.scope == "global" and self.pattern is not None:
            raise ValueError("an N:M pattern is local to each group of m weights; use scope='layer' with it")
        if self.scope == "global" and self.profile != "uniform":
            raise ValueError("a global threshold sets every layer's sparsity itself; use scope='layer' with OWL")
        self.check_profile(self.sparsity, self.pattern)


def global_threshold(weights: list[torch.Tensor], sparsity: float) -> float:
    """The |w| at or below which `sparsity` of all the weights lie (one threshold for every linear)."""
    flat = torch.cat([w.detach().abs().float().flatten() for w in weights])
    count = int(sparsity * flat.numel())
    return -float("inf") if count == 0 else torch.kthvalue(flat, count).values.item()


@register_method(MagnitudeConfig)
class Magnitude(Pruner):
    def begin(self, model: nn.Module) -> None:
        self.threshold = None
        if self.config.scope != "global":
            return
        weights = [
            m.weight
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.startswith("model.layers.") and not self.config.ignores(name)
        ]
        self.threshold = global_threshold(weights, self.config.sparsity)

    def prune_linear(self, name, linear, inputs, scheme):
        w = linear.weight.detach().float()
        if self.threshold is not None:
            return w.masked_fill(w.abs() <= self.threshold, 0.0)
        return w.masked_fill(scheme_mask(w.abs(), scheme, per_row=self.config.scope == "row"), 0.0)
