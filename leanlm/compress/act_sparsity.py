"""Activation sparsity (TEAL, Liu et al. 2024; CATS, Lee et al. 2024): a magnitude threshold per linear,
calibrated so that `sparsity` of its inputs fall at or below it, and the linear replaced by ActSparseLinear,
which zeroes those inputs and, at decode, skips reading the weight rows they would multiply.

TEAL sparsifies the input of every linear of a block (q/k/v, o, gate/up, down), each at its own threshold; the
thresholds come from the calibration inputs the layer loop observes (with earlier layers already sparse). The
summary reports the batch-size effect: at batch B a weight row may be skipped only when all B rows' inputs
are zero there, so the share of rows read grows with B (measured on the calibration rows, B at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import NEEDS_STATS, GroupInputs, MethodConfig, register_method
from leanlm.compress.linear_quantizer import LinearQuantizer
from leanlm.model.sparse.activation import ActSparseLinear

BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ActivationSparsityConfig(MethodConfig):
    sparsity: float = 0.4  # fraction of each linear's calibration inputs at or below its threshold

    name = "act-sparsity"

    def __post_init__(self) -> None:
        if not isinstance(self.sparsity, (int, float)) or not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity must be a fraction in [0, 1), got {self.sparsity!r}")


def threshold_for(samples: torch.Tensor, sparsity: float) -> float:
    """The |x| at or below which `sparsity` of the entries of samples [n, K] lie (0 for sparsity 0)."""
    flat = samples.abs().reshape(-1).float()
    count = int(sparsity * flat.numel())
    return 0.0 if count == 0 else float(torch.kthvalue(flat, count).values)


def rows_read(samples: torch.Tensor, threshold: float, batch: int) -> float:
    """Share of weight rows a batch of `batch` calibration rows must read: those where any row's |x| > threshold
    (consecutive rows of `samples` stand for a batch's requests)."""
    n = samples.shape[0] // batch * batch
    if n == 0:
        return float("nan")
    kept = (samples[:n].abs() > threshold).view(n // batch, batch, -1)
    return float(kept.any(dim=1).float().mean())


@register_method(ActivationSparsityConfig)
class ActivationSparsity(LinearQuantizer):
    needs = frozenset({NEEDS_STATS})

    def __init__(self, config: ActivationSparsityConfig) -> None:
        super().__init__(config)
        self.read: dict[int, list[float]] = {b: [] for b in BATCH_SIZES}  # per batch size, one share per linear

    def quantize_linear(self, linear: nn.Linear, inputs: GroupInputs | None) -> ActSparseLinear:
        if inputs is None or not inputs.samples.numel():
            raise ValueError("activation sparsity calibrates its thresholds on data: pass calibration samples")
        threshold = threshold_for(inputs.samples, self.config.sparsity)
        for batch in BATCH_SIZES:
            self.read[batch].append(rows_read(inputs.samples, threshold, batch))
        return ActSparseLinear.from_linear(linear, threshold)

    def summary(self) -> dict:
        """Mean share of weight rows read per token at each batch size (1 - the input sparsity at batch 1)."""
        return {f"rows read at batch {b}": sum(v) / len(v) for b, v in self.read.items() if v}
