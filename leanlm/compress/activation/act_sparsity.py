"""Activation sparsity (TEAL, Liu et al. 2024; CATS, Lee et al. 2024): a magnitude threshold per linear,
calibrated so that `sparsity` of its inputs fall at or below it, and the linear replaced by ActSparseLinear,
which zeroes those inputs and, at decode, skips reading the weight rows they would multiply.

TEAL sparsifies the input of every linear of a block (q/k/v, o, gate/up, down), each at its own threshold; the
thresholds come from the calibration inputs the layer loop observes (with earlier layers already sparse).
`allocation="greedy"` spreads a layer's sparsity unevenly (TEAL's greedy allocation, here on each linear's own
output error): starting from dense, it raises, one step at a time, the sparsity of the linear whose output
error grows least per weight byte it stops reading, until the layer's bytes-weighted sparsity is `sparsity`.
`allocation="block"` is TEAL's own greedy: the same steps, chosen on the error of the whole layer's output
(leanlm.compress.activation.act_allocation). The summary reports the batch-size effect: at batch B a weight row may be
skipped only when all B rows' inputs are zero there, so the share of rows read grows with B (measured on the
calibration rows, B at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.activation.act_allocation import BLOCK_SEQUENCES, Candidate, block_levels
from leanlm.compress.base import NEEDS_LAYER, NEEDS_STATS, GroupInputs, LayerInputs, MethodConfig, register_method
from leanlm.compress.quantize.linear_quantizer import LinearQuantizer, group_linears
from leanlm.model.linear.act_sparse import ActSparseLinear

BATCH_SIZES = (1, 2, 4, 8, 16)


ALLOCATIONS = ("uniform", "greedy", "block")
SCORES = ("magnitude", "weighted")
_STEP = 0.05  # sparsity increments of the greedy allocation
_ERROR_ROWS = 1024  # calibration rows the greedy allocation measures output errors on


@dataclass(frozen=True)
class ActivationSparsityConfig(MethodConfig):
    # fraction of the inputs zeroed: of each linear's (uniform), or of each layer's weight bytes (greedy)
    sparsity: float = 0.4
    allocation: str = "uniform"
    # what is thresholded: |x_k| (TEAL), or |x_k| * ||W[:, k]|| (the size of input k's share of the output)
    score: str = "magnitude"

    name = "act-sparsity"

    def __post_init__(self) -> None:
        if not isinstance(self.sparsity, (int, float)) or not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity must be a fraction in [0, 1), got {self.sparsity!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")


def threshold_for(samples: torch.Tensor, sparsity: float) -> float:
    """The |x| at or below which `sparsity` of the entries of samples [n, K] lie (0 for sparsity 0)."""
    flat = samples.abs().reshape(-1).float()
    count = int(sparsity * flat.numel())
    return 0.0 if count == 0 else float(torch.kthvalue(flat, count).values)


def rows_read(scores: torch.Tensor, threshold: float, batch: int) -> float:
    """Share of weight rows a batch of `batch` calibration rows must read: those where any row's score [n, K]
    is above the threshold (consecutive rows stand for a batch's requests)."""
    n = scores.shape[0] // batch * batch
    if n == 0:
        return float("nan")
    kept = (scores[:n] > threshold).view(n // batch, batch, -1)
    return float(kept.any(dim=1).float().mean())


def column_scale(weight: torch.Tensor, score: str) -> torch.Tensor:
    """[K] float32: what each input's magnitude is multiplied by before the threshold."""
    if score == "weighted":
        return weight.detach().float().norm(dim=0)
    return torch.ones(weight.shape[1], device=weight.device)


def output_errors(samples: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, levels: list[float]) -> list[float]:
    """Relative output error |s(X) W^T - X W^T|^2 / |X W^T|^2 of a linear at each sparsity level."""
    x = samples[:_ERROR_ROWS].float()
    w = weight.detach().float()
    ref = (x @ w.t()).pow(2).sum().clamp_min(1e-30)
    scores = x.abs() * scale
    errors = []
    for level in levels:
        dropped = x.masked_fill(scores > threshold_for(scores, level), 0)  # what sparsifying removes
        errors.append(float((dropped @ w.t()).pow(2).sum() / ref))
    return errors


def greedy_levels(errors: dict[str, list[float]], sizes: dict[str, int], target: float) -> dict[str, int]:
    """Level index per linear: from all at 0, repeatedly step up the linear whose error grows least per byte
    it stops reading, until the size-weighted sparsity reaches `target`."""
    level = dict.fromkeys(errors, 0)
    total, done = sum(sizes.values()), 0.0
    while done < target * total - 1e-9:
        open_ = [n for n in errors if level[n] + 1 < len(errors[n])]
        if not open_:
            break
        best = min(open_, key=lambda n: (errors[n][level[n] + 1] - errors[n][level[n]]) / sizes[n])
        level[best] += 1
        done += _STEP * sizes[best]
    return level


@register_method(ActivationSparsityConfig)
class ActivationSparsity(LinearQuantizer):
    needs = frozenset({NEEDS_STATS})

    def __init__(self, config: ActivationSparsityConfig) -> None:
        super().__init__(config)
        if config.allocation == "block":  # the loop then calls fit_layer with the layer's input hidden states
            self.needs = frozenset({NEEDS_LAYER, NEEDS_STATS})
        self.rotary = None
        self.read: dict[int, list[float]] = {b: [] for b in BATCH_SIZES}  # per batch size, one share per linear
        self.levels: dict[int, float] = {}  # id(linear) -> its sparsity in the layer at hand (greedy)
        self.by_kind: dict[str, list[float]] = {}  # q_proj, ... -> the sparsity of each such linear

    def apply_layer(self, layer, prefix, inputs):
        self.levels = {}
        if self.config.allocation == "greedy" and inputs is not None:
            linears = {
                full: (m, fed)
                for _, full, m, fed in group_linears(layer, prefix, inputs)
                if isinstance(m, nn.Linear) and not self.config.ignores(full)
            }
            levels = [i * _STEP for i in range(int(0.9 / _STEP) + 1)]
            errors = {
                n: output_errors(fed.samples, m.weight, column_scale(m.weight, self.config.score), levels)
                for n, (m, fed) in linears.items()
            }
            chosen = greedy_levels(errors, {n: m.weight.numel() for n, (m, _) in linears.items()}, self.config.sparsity)
            self.levels = {id(linears[n][0]): levels[i] for n, i in chosen.items()}
            for n, i in chosen.items():
                self.by_kind.setdefault(n.rsplit(".", 1)[-1], []).append(levels[i])
        return super().apply_layer(layer, prefix, inputs)

    def begin(self, model: nn.Module) -> None:
        self.rotary = model.rotary_emb

    def fit_layer(self, layer: nn.Module, prefix: str, inputs: LayerInputs) -> list:
        """allocation="block": on the group inputs the loop observed, TEAL's greedy on the layer's
        output (on its first BLOCK_SEQUENCES sequences), then the thresholds at the chosen levels."""
        hidden = inputs.hidden  # [S, T, d]
        rope = self.rotary(torch.arange(hidden.shape[1], device=hidden.device), hidden.dtype)
        fed = inputs.groups  # the loop observed them (NEEDS_STATS)
        levels = [i * _STEP for i in range(int(0.9 / _STEP) + 1)]
        candidates = {}
        for _, full, m, group in group_linears(layer, prefix, fed):
            if isinstance(m, nn.Linear) and not self.config.ignores(full):
                scale = column_scale(m.weight, self.config.score)
                scores = group.samples.abs() * scale
                candidates[full] = Candidate(m, scale, [threshold_for(scores, level) for level in levels])
        chosen = block_levels(layer, hidden[:BLOCK_SEQUENCES], rope, candidates, levels, self.config.sparsity)
        self.levels = {id(candidates[n].linear): level for n, level in chosen.items()}
        for n, level in chosen.items():
            self.by_kind.setdefault(n.rsplit(".", 1)[-1], []).append(level)
        return LinearQuantizer.apply_layer(self, layer, prefix, fed)

    def quantize_linear(self, linear: nn.Linear, inputs: GroupInputs | None) -> ActSparseLinear:
        if inputs is None or not inputs.samples.numel():
            raise ValueError("activation sparsity calibrates its thresholds on data: pass calibration samples")
        scale = column_scale(linear.weight, self.config.score)
        scores = inputs.samples.abs() * scale
        threshold = threshold_for(scores, self.levels.get(id(linear), self.config.sparsity))
        for batch in BATCH_SIZES:
            self.read[batch].append(rows_read(scores, threshold, batch))
        return ActSparseLinear.from_linear(linear, threshold, scale)

    def summary(self) -> dict:
        """Mean share of weight rows read per token at each batch size (1 - the input sparsity at batch 1), and
        the mean sparsity the greedy allocation gave each kind of linear."""
        read = {f"weight rows read at batch {b}": sum(v) / len(v) for b, v in self.read.items() if v}
        return read | {f"{kind} sparsity": sum(v) / len(v) for kind, v in self.by_kind.items()}
