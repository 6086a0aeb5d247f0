"""What a mixture-of-experts model reads per token and per step (pure functions over a ModelShape): active against
total parameters and bytes, the distinct experts a batch touches under uniform top-k routing, and the batch at
which a decode step reads every expert, after which the MoE's bytes per step stop growing with the batch.

Under uniform, independent top-k routing each expert of a layer is missed by one token with probability 1 - k/E, so
T tokens touch E * (1 - (1 - k/E)^T) distinct experts in expectation (estimate.expected_experts_touched); that
reaches a share c of E at T = ln(1 - c) / ln(1 - k/E). Trained routers are skewed, which makes coverage slower:
the uniform batch is a lower bound on where every expert is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from leanlm.analysis import estimate as est
from leanlm.analysis.model_shape import ModelShape


@dataclass(frozen=True)
class ExpertCoverage:
    """One decode step of `batch` tokens (one per sequence): the experts and weight bytes it reads."""

    batch: int  # tokens in the step
    experts_per_layer: float  # expected distinct routed experts touched, of E, in each MoE layer
    weight_bytes: float  # weight bytes the step streams (estimate.streamed_weight_bytes)
    bytes_per_token: float  # weight_bytes / batch


@dataclass(frozen=True)
class MoESummary:
    total_params: int
    active_params: int  # attention, router, k experts, shared expert, norms, embedding and head
    total_weight_bytes: float  # every weight at rest
    active_bytes_per_token: float  # one token alone (batch-1 decode): attention, router, its k experts, the
    # shared expert, norms, one embedding row and the head
    coverage: float  # the share of E below
    all_experts_batch: int  # smallest decode batch whose expected distinct experts reach `coverage` * E
    steps: tuple[ExpertCoverage, ...]  # decode bytes per step against the batch


def batch_for_coverage(s: ModelShape, coverage: float = 0.99) -> int:
    """Smallest T with E * (1 - (1 - k/E)^T) >= coverage * E; 1 when every token runs every expert (k = E)."""
    if not 0 < coverage < 1:
        raise ValueError(f"expert coverage must be in (0, 1), got {coverage}; 0.99 means 99% of the experts")
    if not s.is_moe or s.experts_per_token == s.num_experts:
        return 1
    # ceil, then step down past float rounding: the returned batch must be the smallest that reaches coverage
    t = max(1, math.ceil(math.log(1 - coverage) / math.log(1 - s.experts_per_token / s.num_experts)))
    while t > 1 and est.expected_experts_touched(s, t - 1) >= coverage * s.num_experts:
        t -= 1
    return t


def coverage_row(s: ModelShape, fmt: est.NumberFormat, batch: int) -> ExpertCoverage:
    weight_bytes = est.streamed_weight_bytes(s, fmt, batch)
    return ExpertCoverage(batch, est.expected_experts_touched(s, batch), weight_bytes, weight_bytes / batch)


def coverage_batches(all_experts_batch: int, asked: int) -> list[int]:
    """Powers of two up to past the all-experts batch, that batch, and the asked one."""
    powers, b = [], 1
    while b < 2 * all_experts_batch:
        powers.append(b)
        b *= 2
    return sorted({*powers, all_experts_batch, asked})


def moe_summary(s: ModelShape, fmt: est.NumberFormat, batch: int = 1, coverage: float = 0.99) -> MoESummary:
    """Active against total, and decode bytes per step from batch 1 to past the batch that reads every expert."""
    p = est.param_counts(s)
    all_experts = batch_for_coverage(s, coverage)
    return MoESummary(
        total_params=p.total,
        active_params=p.active,
        total_weight_bytes=est.weight_bytes(s, fmt),
        active_bytes_per_token=est.streamed_weight_bytes(s, fmt, 1),
        coverage=coverage,
        all_experts_batch=all_experts,
        steps=tuple(coverage_row(s, fmt, b) for b in coverage_batches(all_experts, batch)),
    )
