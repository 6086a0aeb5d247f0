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


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |v| (8 significant bits)."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


def check_against_float64(y, x, w_deq, bias, slack_weight):
    """y against x @ w_deq^T + bias in float64: per element half a bf16 ulp plus fp32 accumulation slack
    (|x| @ slack_weight^T scaled by a chain depth), and the whole output's SQNR and max error."""
    ref = x.double() @ w_deq.T + (bias.double() if bias is not None else 0.0)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    K = x.shape[-1]
    slack = (K // 16 + 64) * EPS32 * (x.double().abs() @ slack_weight.T)
    if bias is not None:
        slack = slack + 2 * EPS32 * bias.double().abs()
    err = (y.double() - ref).abs()
    bound = 0.5 * bf16_ulp(ref).double() * (1 + 2**-7) + slack
    assert (err <= bound).all(), f"max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    noise = (y.double() - ref).pow(2).sum()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / noise.clamp_min(1e-300))
    assert sqnr >= 40 and err.max() <= 1e-2 * ref.abs().max(), (sqnr, err.max())
