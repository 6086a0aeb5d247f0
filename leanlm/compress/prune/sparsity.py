"""Sparsity targets and mask selection, shared by every pruning method (magnitude, Wanda, SparseGPT).

A mask is a bool tensor shaped like the weight, True where the weight is pruned (set to zero). Scores are
"how much it costs to prune this weight": the lowest-scoring entries go first. N:M patterns keep n of every m
consecutive input columns of each output row (2:4 keeps 2 of 4), the layout sparse tensor cores and
LeanLM's 2:4 kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparsityScheme:
    """What to prune: a fraction of the weights (`sparsity`), or an N:M `pattern` ("2:4", "4:8")."""

    sparsity: float | None = None  # fraction of each unit's weights set to zero; default 0.5 without a pattern
    pattern: str | None = None  # "n:m": keep n of every m consecutive input weights of a row
    # 2:4 linears still float when the recipe ends become the Sparse24Linear runtime module (its kernels read
    # 56% of the dense bytes), unstructured ones at least bitmask.MIN_SPARSITY zero BitmaskSparseLinear; False
    # keeps them float, e.g. to fine-tune them
    pack: bool = True

    def __post_init__(self) -> None:
        if self.pattern is not None:
            n, m = parse_pattern(self.pattern)
            implied = 1 - n / m
            if self.sparsity is not None and abs(self.sparsity - implied) > 1e-9:
                raise ValueError(
                    f"pattern {self.pattern} prunes {implied:.0%} of the weights, but sparsity={self.sparsity} was "
                    "also given; pass one of them"
                )
            object.__setattr__(self, "sparsity", implied)
        elif self.sparsity is None:
            object.__setattr__(self, "sparsity", 0.5)
        if not isinstance(self.sparsity, (int, float)) or not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity must be a fraction in [0, 1), got {self.sparsity!r}")

    @property
    def nm(self) -> tuple[int, int] | None:
        """(n kept, m) of the N:M pattern, or None for unstructured sparsity."""
        return None if self.pattern is None else parse_pattern(self.pattern)

    @property
    def sparsity_label(self) -> str:
        return self.pattern if self.pattern is not None else f"{self.sparsity:.0%} unstructured"

    def check_shape(self, in_features: int) -> None:
        if self.nm is not None and in_features % self.nm[1]:
            raise ValueError(
                f"pattern {self.pattern} needs in_features divisible by {self.nm[1]}, got {in_features}; "
                "add the layer to `ignore` or use unstructured sparsity"
            )


def parse_pattern(pattern: str) -> tuple[int, int]:
    """'2:4' -> (2, 4): n kept of every m, 0 < n < m."""
    try:
        n, m = (int(p) for p in pattern.split(":"))
    except (AttributeError, ValueError):
        raise ValueError(f"pattern must look like '2:4' (keep n of every m weights), got {pattern!r}") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern}: need 0 < n < m (keep n of every m weights)")
    return n, m


def lowest_mask(scores: torch.Tensor, sparsity: float, per_row: bool) -> torch.Tensor:
    """Prune the `sparsity` fraction of lowest scores [N, K] -> mask [N, K]: exactly floor(sparsity * K) per
    row (per_row), or floor(sparsity * N * K) over the whole matrix."""
    flat = scores if per_row else scores.reshape(1, -1)
    count = int(sparsity * flat.shape[1])
    mask = torch.zeros_like(flat, dtype=torch.bool)
    if count:
        mask.scatter_(1, torch.topk(flat, count, dim=1, largest=False).indices, True)
    return mask.view_as(scores)


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the n highest of every m consecutive scores of each row: scores [N, K] (K % m == 0) -> mask [N, K]."""
    rows, k = scores.shape
    groups = scores.reshape(rows, k // m, m)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(2, torch.topk(groups, m - n, dim=2, largest=False).indices, True)
    return mask.view(rows, k)


def wanda_scores(weight: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """Wanda's |W_ij| * ||X_j|| for weight [N, K] and the mean square of each input channel [K] -> float32 [N, K]
    (sqrt(mean x_j^2) = ||X_j|| / sqrt(n): the same order within a row, and across linears fed the same tokens)."""
    return weight.detach().abs().float() * mean_sq.sqrt()


def scheme_mask(scores: torch.Tensor, scheme: SparsityScheme, per_row: bool) -> torch.Tensor:
    """The scheme's mask for one weight's scores [N, K]: its N:M pattern, else its unstructured fraction."""
    if scheme.nm is not None:
        return nm_mask(scores, *scheme.nm)
    return lowest_mask(scores, scheme.sparsity, per_row)


def satisfies_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True when no m consecutive input weights of any row [N, K] hold more than n nonzeros."""
    rows, k = weight.shape
    return k % m == 0 and bool(((weight.reshape(rows, k // m, m) != 0).sum(-1) <= n).all())
