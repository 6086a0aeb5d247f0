"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights with per-channel scales
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), folded into the preceding norm or linear, so that W8A8 with
per-token activation scales (a following quantizer, e.g. RTNConfig(bits=8, act_bits=8)) loses little."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.compress.base import NEEDS_STATS, GroupInputs, Method, MethodConfig, register_method
from leanlm.compress.transform.smoothing import fold_scales, foldable_groups, weight_absmax


@dataclass(frozen=True)
class SmoothQuantConfig(MethodConfig):
    alpha: float = 0.5  # migration strength: 0 leaves activations alone, 1 moves all range into weights

    name = "smoothquant"

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


def smoothing_scales(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K]; channels never active (or with zero weights) keep s = 1."""
    a, w = act_absmax.double(), w_absmax.double()
    s = a.pow(alpha) / w.pow(1 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp_min(1e-5).float()


@register_method(SmoothQuantConfig)
class SmoothQuant(Method):
    needs = frozenset({NEEDS_STATS})

    def apply_layer(self, layer, prefix, inputs: dict[str, GroupInputs] | None):
        for group in foldable_groups(layer):
            stats = inputs[group.linears[0]]
            s = smoothing_scales(stats.absmax, weight_absmax(layer, group.linears), self.config.alpha)
            fold_scales(layer, group.producer, group.linears, s)
        return []
