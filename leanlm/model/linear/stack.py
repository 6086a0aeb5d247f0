"""E experts of one weight format with their tensors stacked [E, ...], what a grouped GEMM over a mixture of
experts reads, and the reference grouped forward such a kernel is tested against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class StackedLinear:
    """Experts of one format and one shape: every tensor of expert e is tensors[name][e]."""

    layer_type: type  # the format's layer class; it rebuilds expert e (from_tensors)
    metadata: dict[str, Any]  # the format's settings, the same for every expert
    tensors: dict[str, torch.Tensor]  # name -> [E, *the expert's tensor shape]
    experts: list = field(default_factory=list, compare=False, repr=False)  # expert(e) for each e, made once

    def __post_init__(self) -> None:
        sizes = {t.shape[0] for t in self.tensors.values()}
        if len(sizes) != 1:
            raise ValueError(f"stacked tensors hold different expert counts {sorted(sizes)}")

    @classmethod
    def of(cls, layers: list) -> StackedLinear:
        """Stack `layers` (one format, same settings and tensor shapes); ValueError naming what differs."""
        if not layers:
            raise ValueError("stack needs at least one expert layer")
        first = layers[0]
        kind, meta, own = type(first), first.metadata(), first.stack_tensors()
        for e, layer in enumerate(layers[1:], 1):
            if type(layer) is not kind or layer.metadata() != meta:
                raise ValueError(
                    f"expert {e} is {type(layer).__name__} {layer.metadata()}, expert 0 {kind.__name__} {meta}: "
                    "a stack holds one format with one set of settings"
                )
            theirs = layer.stack_tensors()
            for name in own.keys() | theirs.keys():
                a, b = own.get(name), theirs.get(name)
                if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(
                        f"expert {e}'s tensor {name} is {_describe(b)}, expert 0's {_describe(a)}: stacked experts "
                        "need tensors of one shape and dtype"
                    )
        tensors = {name: torch.stack([layer.stack_tensors()[name] for layer in layers]) for name in own}
        return cls(kind, meta, tensors)

    @property
    def num_experts(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def expert(self, e: int):
        """Expert e as a layer of the format, built once (its tensors are the stack's, or copies of them)."""
        if not self.experts:
            self.experts.extend(
                self.layer_type.from_tensors(self.metadata, {name: t[i] for name, t in self.tensors.items()})
                for i in range(self.num_experts)
            )
        return self.experts[e]

    def dequantized_weights(self) -> torch.Tensor:
        """float32 [E, N, K]: every expert's weight, what a grouped GEMM over dequantized weights multiplies."""
        return torch.stack([self.expert(e).dequantized_weight() for e in range(self.num_experts)])

    def reference_forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """y [T, N]: row t of x [T, K] through expert expert_ids[t] ([T] int), one product per expert over the rows
        routed to it (a grouped GEMM's grouping), each on the format's own no-kernel path (its fallback: per-token
        activation scales, thresholds and outliers included), in x's dtype."""
        if expert_ids.shape != x.shape[:1] or expert_ids.dtype.is_floating_point:
            raise ValueError(f"expert_ids must be integers [T] = [{x.shape[0]}], got {expert_ids.dtype} "
                             f"{list(expert_ids.shape)}")  # fmt: skip
        if expert_ids.numel() and not 0 <= int(expert_ids.min()) <= int(expert_ids.max()) < self.num_experts:
            raise ValueError(f"expert_ids must lie in [0, {self.num_experts})")
        y = x.new_zeros(x.shape[0], self.metadata["out_features"])
        for e in torch.unique(expert_ids).tolist():
            rows = (expert_ids == e).nonzero().squeeze(1)
            y[rows] = self.expert(e).fallback(x[rows])
        return y


def _describe(t: torch.Tensor | None) -> str:
    return "absent" if t is None else f"{t.dtype} {list(t.shape)}"
