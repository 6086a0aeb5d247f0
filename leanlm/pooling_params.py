"""PoolingParams: what an embedding request asks (vLLM's name): how the prompt's final hidden states become one
vector. An embedding request runs through the same engine as generation, prefill only, and samples nothing."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean")  # last: the final token's hidden state (causal LMs, e5/gte-Qwen); mean: all tokens'


@dataclass(frozen=True)
class PoolingParams:
    """How one prompt becomes an embedding. Validated on construction."""

    pooling: str = "last"  # one of POOLING_TYPES
    normalize: bool = True  # scale to unit L2 norm (cosine similarity is then a dot product)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")

    @property
    def needs_every_token(self) -> bool:
        """Mean pooling reads every prompt position's hidden state: no position may come from the prefix cache."""
        return self.pooling == "mean"
