"""OWL (Yin et al. 2023, "Outlier Weighed Layerwise Sparsity"): spread an unstructured sparsity target over
the decoder layers instead of pruning each to the same fraction. A layer's outlier ratio is the share of its
Wanda scores |W_ij| * ||X_j|| above `m` times their mean, on the uncompressed model; layers with more outliers
are pruned less. The ratios are mapped linearly onto a range 2 lambda wide (most outliers -> lowest sparsity),
shifted so that the layers' mean sparsity is the target; the decoder layers are the same size, so the model
prunes as many weights as a uniform prune would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import GroupInputs
from leanlm.compress.prune.sparsity import wanda_scores

PROFILES = ("uniform", "owl")


@dataclass(frozen=True)
class LayerProfile:
    """How a pruner's unstructured `sparsity` is spread over the decoder layers: the same in each ("uniform"),
    or by their outlier ratios ("owl": at most `owl_lambda` either side of the target, outliers above `owl_m`
    times the layer's mean score). The configs that take it call check_profile from __post_init__."""

    profile: str = "uniform"
    owl_m: float = 5.0
    owl_lambda: float = 0.08

    def check_profile(self, sparsity: float, pattern: str | None) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.profile == "uniform":
            return
        if pattern is not None:
            raise ValueError(f"OWL varies the fraction pruned per layer; pattern {pattern} fixes it: use --sparsity")
        if not self.owl_m > 0:
            raise ValueError(f"owl_m (outliers are scores above owl_m x the layer mean) must be > 0, got {self.owl_m}")
        # a layer's sparsity lies within 2 lambda of the target (the mean sits anywhere in the range)
        if not 0 < 2 * self.owl_lambda <= sparsity or sparsity + 2 * self.owl_lambda >= 1:
            raise ValueError(
                f"owl_lambda={self.owl_lambda} must be > 0 and keep every layer's sparsity (within 2 x owl_lambda "
                f"of the target {sparsity}) in [0, 1): at most {min(sparsity, 1 - sparsity) / 2:.3f} here"
            )


def layer_scores(layer: nn.Module, inputs: dict[str, GroupInputs], ignores) -> torch.Tensor:
    """Every Wanda score |W_ij| * sqrt(mean x_j^2) of the layer's linears that are pruned (not `ignores(name)`),
    flattened into one float32 vector."""
    scores = []
    for group in layer.linear_groups:
        mean_sq = inputs[group.linears[0]].mean_sq  # [K]
        for name in group.linears:
            if not ignores(name):
                scores.append(wanda_scores(layer.get_submodule(name).weight, mean_sq).flatten())
    return torch.cat(scores) if scores else torch.zeros(0)


def outlier_ratio(scores: torch.Tensor, m: float) -> float:
    """The share of `scores` above m times their mean (OWL's layerwise outlier distribution, as a fraction)."""
    if scores.numel() == 0:
        return 0.0
    return float((scores > m * scores.mean()).float().mean())


def owl_sparsities(ratios: list[float], target: float, lam: float) -> list[float]:
    """Each layer's sparsity: its outlier ratio mapped linearly onto a range of width 2 lambda (the most outliers
    -> the least sparsity), centred so that the mean is `target`. Equal ratios give the target everywhere."""
    r = torch.tensor(ratios, dtype=torch.float64)
    spread = r.max() - r.min()
    if len(ratios) == 0 or spread <= 0:
        return [target] * len(ratios)
    shifted = (r - r.min()) / spread * 2 * lam  # [0, 2 lambda]
    return [float(s) for s in target - (shifted - shifted.mean())]


class LayerPlan:
    """The per-layer sparsity of one pruner: outlier ratios gathered by plan_layer, sparsities on first use."""

    def __init__(self, config) -> None:
        self.config = config
        self.ratios: dict[str, float] = {}
        self.sparsity: dict[str, float] | None = None

    def observe(self, prefix: str, layer: nn.Module, inputs: dict[str, GroupInputs]) -> None:
        ignores = lambda name: self.config.ignores(f"{prefix}.{name}")  # noqa: E731
        self.ratios[prefix] = outlier_ratio(layer_scores(layer, inputs, ignores), self.config.owl_m)
        self.sparsity = None

    def sparsities(self) -> dict[str, float]:
        """Layer prefix -> its sparsity, from the ratios observed so far."""
        if self.sparsity is None:
            names = list(self.ratios)
            values = owl_sparsities([self.ratios[n] for n in names], self.config.sparsity, self.config.owl_lambda)
            self.sparsity = dict(zip(names, values, strict=True))
        return self.sparsity

    def scheme(self, prefix: str):
        """The config with layer `prefix`'s sparsity (the config itself for layers the plan did not see)."""
        sparsity = self.sparsities().get(prefix)
        if sparsity is None:
            return self.config
        return dataclasses.replace(self.config, sparsity=sparsity, profile="uniform")

    def summary(self) -> dict[str, float]:
        values = list(self.sparsities().values())
        return {"OWL layer sparsity min": min(values), "OWL layer sparsity max": max(values)} if values else {}
