"""Random bf16 linear-layer inputs shared by the kernel tests."""

from __future__ import annotations

import torch

EPS32 = 2.0**-23


def linear_inputs(M: int, N: int, K: int, has_bias: bool, seed: int = 0):
    """x [M, K], weight [N, K] (scaled so outputs are O(1)) and bias [N] or None, all bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16) if has_bias else None
    return x, w, b
