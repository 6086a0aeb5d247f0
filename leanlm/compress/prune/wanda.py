"""Wanda (Sun et al. 2023): prune by |W_ij| * ||X_j||_2, the weight's size times the norm of the input that
multiplies it over the calibration tokens, comparing weights within each output row (or within each group
of m for N:M). One forward pass of statistics, no weight update."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.compress.base import NEEDS_STATS, MethodConfig, register_method
from leanlm.compress.prune.owl import LayerProfile
from leanlm.compress.prune.pruner import Pruner
from leanlm.compress.prune.sparsity import SparsityScheme, scheme_mask, wanda_scores


@dataclass(frozen=True)
class WandaConfig(MethodConfig, SparsityScheme, LayerProfile):
    per_row: bool = True  # compare scores within each output row (the paper's choice), else the whole layer

    name = "wanda"

    def __post_init__(self) -> None:
        SparsityScheme.__post_init__(self)
        self.check_profile(self.sparsity, self.pattern)


@register_method(WandaConfig)
class Wanda(Pruner):
    needs = frozenset({NEEDS_STATS})

    def prune_linear(self, name, linear, inputs, scheme):
        w = linear.weight.detach().float()  # [N, K]
        scores = wanda_scores(w, inputs.mean_sq)
        return w.masked_fill(scheme_mask(scores, scheme, per_row=self.config.per_row), 0.0)
