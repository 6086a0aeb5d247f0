"""The load balance of a mixture-of-experts model in training: Switch Transformer's auxiliary loss (Fedus et al.
2021) over every sparse layer's routing of the forward that just ran, and the expert load it counts on the way.

    balance = RoutingBalance.of(model)            # None for a dense model
    loss = causal_lm_loss(model, ids) + balance.coef * balance.loss()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.model.moe import SparseMoeBlock, load_balancing_loss


@dataclass
class RoutingBalance:
    """The sparse layers of one model and the assignments their routers made since the last `take_counts`."""

    layer_ids: list[int]  # decoder layers with experts, in order
    blocks: list[SparseMoeBlock]
    coef: float  # the model's router_aux_loss_coef: the loss's weight beside the next-token loss
    counts: torch.Tensor | None = None  # [L, E] long on the model's device: assignments per layer and expert

    @classmethod
    def of(cls, model: nn.Module) -> RoutingBalance | None:
        """The model's sparse layers, or None when it has none (a dense model trains as before)."""
        moe = getattr(model.config, "moe", None)
        pairs = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        if moe is None or not pairs:
            return None
        return cls([i for i, _ in pairs], [b for _, b in pairs], float(moe.router_aux_loss_coef))

    def loss(self) -> torch.Tensor:
        """Mean over the sparse layers of E * sum_e f_e P_e (1.0 when routing is uniform) for the forward that just
        ran with grad enabled; counts its assignments. Its gradient reaches only the routers (f_e is a count)."""
        routings = [b.last_routing for b in self.blocks]
        if any(r is None for r in routings):
            raise RuntimeError("a sparse layer kept no routing: run the forward with grad enabled before loss()")
        num_experts = self.blocks[0].moe.num_experts
        counts = torch.stack([torch.bincount(r.experts.reshape(-1), minlength=num_experts) for r in routings])
        self.counts = counts if self.counts is None else self.counts + counts
        for b in self.blocks:
            b.last_routing = None  # read once: the next forward sets it again, and the graph is not kept alive
        return torch.stack([load_balancing_loss(r.probs, r.experts) for r in routings]).mean()

    def take_counts(self) -> dict[int, list[int]]:
        """The counted assignments {layer_idx: [E]} as plain ints (one device sync), and zero to count again."""
        counts = {} if self.counts is None else dict(zip(self.layer_ids, self.counts.tolist(), strict=True))
        self.counts = None
        return counts


def add_load(total: dict[int, list[int]], counts: dict[int, list[int]]) -> dict[int, list[int]]:
    """Running {layer_idx: [E]} assignment counts."""
    out = {i: list(row) for i, row in total.items()}
    for i, row in counts.items():
        out[i] = [a + b for a, b in zip(out.get(i, [0] * len(row)), row, strict=True)]
    return out


@dataclass(frozen=True)
class LayerLoad:
    """One sparse layer's share of the assignments over a run, and how even it was."""

    layer_idx: int
    shares: tuple[float, ...]  # [E] fraction of the layer's assignments each expert got (sums to 1)

    @property
    def max_over_mean(self) -> float:
        """max_e share / (1 / E): 1.0 is perfectly even, E is one expert taking everything."""
        return max(self.shares) * len(self.shares)

    @property
    def cv(self) -> float:
        """Coefficient of variation of the shares (std / mean, population std): 0.0 is perfectly even."""
        mean = 1 / len(self.shares)
        return (sum((s - mean) ** 2 for s in self.shares) / len(self.shares)) ** 0.5 / mean


def layer_loads(counts: dict[int, list[int]]) -> list[LayerLoad]:
    """Counts {layer_idx: [E]} as each layer's shares, in layer order."""
    return [LayerLoad(i, tuple(c / max(sum(row), 1) for c in row)) for i, row in sorted(counts.items())]


def describe_load(loads: list[LayerLoad]) -> str:
    """One line for a run's summary: the spread of max/mean and CV over the layers."""
    if not loads:
        return "expert load: none counted"
    worst = max(loads, key=lambda x: x.max_over_mean)
    mean_cv = sum(x.cv for x in loads) / len(loads)
    mean_mm = sum(x.max_over_mean for x in loads) / len(loads)
    return (
        f"expert load over {len(loads)} sparse layers: max/mean share {mean_mm:.2f} on average, worst "
        f"{worst.max_over_mean:.2f} (layer {worst.layer_idx}); CV {mean_cv:.2f} on average (0 = even)"
    )
