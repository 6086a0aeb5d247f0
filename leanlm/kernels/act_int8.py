"""Dynamic int8 activations per group of 32 inputs (llama.cpp's Q8_0 / Q8_1 blocks): the numerics the a8 kernels
(gemm_a8.c, the AVX2 GEMVs' int8 paths) compute, as PyTorch, their fallback and the reference they are tested on."""

from __future__ import annotations

import torch

_EPS = 1e-12  # the smallest scale: an all-zero group quantizes to zeros, not NaN

ACT_GROUP = 32  # inputs per dynamic activation scale (llama.cpp's Q8_0 / Q8_1 blocks, OpenVINO's CPU default)


def quantize_act_int8(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per `group` consecutive inputs of x [..., K] (K a multiple of group) -> (codes int8
    [..., K], scales float32 [..., K / group]): W4A8 / W8A8-dynamic activations, as gemm_a8.c computes them."""
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"activation groups of {group} need K a multiple of {group}, not {k}")
    xg = x.float().reshape(*x.shape[:-1], k // group, group)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(_EPS)
    codes = torch.round(xg / scale).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(x.shape), scale.squeeze(-1)


def fake_quantize_act_int8(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """x [..., K] through quantize_act_int8 and back, in float32: the input a W4A8 / W8A8-dynamic layer multiplies."""
    codes, scale = quantize_act_int8(x, group)
    k = x.shape[-1]
    return (codes.float().reshape(*x.shape[:-1], k // group, group) * scale[..., None]).reshape(x.shape)
