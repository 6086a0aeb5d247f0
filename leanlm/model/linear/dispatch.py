"""The one rule that picks a linear layer's kernel for the rows it is given: the packed GEMM from
cpu_gemm.MIN_ROWS 2-D rows on, the few-row GEMV below, and the format's own fallback otherwise."""

from __future__ import annotations

import torch

from leanlm.kernels import cpu_gemm


def is_many_rows(x: torch.Tensor) -> bool:
    """x [M, K] with M >= cpu_gemm.MIN_ROWS: the packed GEMM's row counts (the GEMVs take at most MAX_ROWS = 8)."""
    return x.dim() == 2 and x.shape[0] >= cpu_gemm.MIN_ROWS


class KernelDispatch:
    """forward(x) for a weight format that declares its kernels: `many_rows` where `many_rows_fit` (9+ rows),
    `few_rows` where `few_rows_fit` (every other shape), else `fallback` (its reference path, or a dense copy).

    A format defines `fallback(x)`, and `many_rows(x)` / `few_rows(x)` where it says they fit: it only states
    when each of its kernels takes the rows; this class alone orders them. The fit predicates of different row
    counts never overlap (the GEMVs take at most 8 rows), so the order is the one each layer had on its own.
    """

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        """The format's many-row kernel takes these 9+ rows (the default: it has none)."""
        return False

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        """The format's few-row kernel takes these rows (the default: it has none)."""
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if is_many_rows(x):
            if self.many_rows_fit(x):
                return self.many_rows(x)
        elif self.few_rows_fit(x):
            return self.few_rows(x)
        return self.fallback(x)
