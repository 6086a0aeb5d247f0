"""How sparse a model's weights are: the fraction of exact zeros in each decoder linear, per layer and kind,
whatever stores them (float, quantized codes, a sparse runtime format). `leanlm eval` and `leanlm prune`
print it next to their numbers. For activation-sparse layers (TEAL), `InputSparsityMeter` counts the inputs
they zero on the text being evaluated."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from leanlm.kernels.cpu_act_sparse import sparsify
from leanlm.model.linear.act_sparse import ActSparseLinear
from leanlm.model.linear.base import RuntimeLinear


@dataclass(frozen=True)
class LinearSparsity:
    name: str  # full module name, e.g. model.layers.3.mlp.down_proj
    zeros: int
    numel: int

    @property
    def fraction(self) -> float:
        return self.zeros / max(self.numel, 1)


def linear_sparsity(model: nn.Module) -> list[LinearSparsity]:
    """Zeros of every decoder-layer linear's weight (dequantized for runtime formats), in module order."""
    out = []
    for name, module in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        if isinstance(module, RuntimeLinear):
            weight = module.dequantized_weight()
        elif isinstance(module, nn.Linear):
            weight = module.weight.detach()
        else:
            continue
        out.append(LinearSparsity(name, int((weight == 0).sum()), weight.numel()))
    return out


def overall(rows: list[LinearSparsity]) -> float:
    return sum(r.zeros for r in rows) / max(sum(r.numel for r in rows), 1)


def by_layer(rows: list[LinearSparsity]) -> dict[int, float]:
    """Layer index -> fraction of zeros over its linears."""
    zeros: dict[int, list[int]] = {}
    for r in rows:
        idx = int(r.name.split(".")[2])
        z, n = zeros.setdefault(idx, [0, 0])
        zeros[idx] = [z + r.zeros, n + r.numel]
    return {idx: z / max(n, 1) for idx, (z, n) in sorted(zeros.items())}


def by_kind(rows: list[LinearSparsity]) -> dict[str, float]:
    """Linear kind (q_proj, down_proj, ...) -> fraction of zeros over the layers."""
    zeros: dict[str, list[int]] = {}
    for r in rows:
        kind = r.name.rsplit(".", 1)[-1]
        z, n = zeros.setdefault(kind, [0, 0])
        zeros[kind] = [z + r.zeros, n + r.numel]
    return {kind: z / max(n, 1) for kind, (z, n) in zeros.items()}


def format_sparsity(rows: list[LinearSparsity]) -> str:
    """A few lines: overall, per kind, and per layer (min / max and the layers' values in order)."""
    if not rows:
        return "no decoder linears found"
    layers = by_layer(rows)
    kinds = "  ".join(f"{k} {v:.1%}" for k, v in by_kind(rows).items())
    per_layer = " ".join(f"{v:.0%}" for v in layers.values())
    return "\n".join(
        [
            f"weight sparsity of the decoder linears: {overall(rows):.2%} zeros "
            f"(layers {min(layers.values()):.1%} - {max(layers.values()):.1%})",
            f"  by kind: {kinds}",
            f"  by layer: {per_layer}",
        ]
    )


@torch.no_grad()
def model_sparsity(model: nn.Module) -> str:
    return format_sparsity(linear_sparsity(model))


class InputSparsityMeter:
    """While entered, counts the inputs each activation-sparse linear of `model` zeroes (|x_k| * scale_k at or
    below its threshold) in the forward passes it sees: prefill and scoring run the modules, so `leanlm eval ppl`
    measures the sparsity its perplexity was computed at. The native decode loop bypasses the modules and is
    not counted."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, ActSparseLinear)}
        self.counts: dict[str, list[int]] = {name: [0, 0] for name in self.layers}  # name -> [zeroed, seen]
        self.handles: list = []

    def __enter__(self) -> InputSparsityMeter:
        self.handles = [m.register_forward_pre_hook(partial(self._count, name)) for name, m in self.layers.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @torch.no_grad()
    def _count(self, name: str, module: ActSparseLinear, args: tuple) -> None:
        x = args[0]
        zeroed = sparsify(x, module.threshold_value, module.column_scale) == 0
        self.counts[name][0] += int(zeroed.sum())
        self.counts[name][1] += zeroed.numel()

    def rows(self) -> list[LinearSparsity]:
        return [LinearSparsity(name, zeroed, seen) for name, (zeroed, seen) in self.counts.items() if seen]

    def format(self) -> str | None:
        """Overall and per kind, or None when the model has no activation-sparse linear that ran."""
        rows = self.rows()
        if not rows:
            return None
        kinds = "  ".join(f"{k} {v:.1%}" for k, v in by_kind(rows).items())
        head = f"input sparsity of the activation-sparse linears on this text: {overall(rows):.2%} zeroed"
        return f"{head}\n  by kind: {kinds}"
