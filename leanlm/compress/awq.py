"""AWQ (Lin et al. 2024): protect salient weight channels by scaling them up before quantization. Per
linear group, search s = mean|x|^r over a grid of r for the smallest output error of the quantized group,
fold s into the producer; then search a per-group clipping range. A quantizer (RTN) follows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.compress.base import NEEDS_STATS, GroupInputs, Method, MethodConfig, register_method
from leanlm.compress.quant import fake_quantize
from leanlm.compress.scheme import IntScheme
from leanlm.compress.smoothing import fold_scales, foldable_groups, set_tensor

CLIP_SKIP = ("q_proj", "k_proj")  # attention-score inputs: clipping them hurts (as in the AWQ reference)


@dataclass(frozen=True)
class AWQConfig(MethodConfig, IntScheme):
    n_grid: int = 20  # exponents r = 0, 1/n, ..., (n-1)/n tried for the scales
    clip: bool = True  # also search per-group clipping ranges
    max_shrink: float = 0.5  # clipping tries max |w| * (1 - i / n_grid) down to (1 - max_shrink)
    max_search_rows: int = 1024  # calibration rows used by the scale search
    max_clip_rows: int = 256  # and by the clipping search

    name = "awq"

    def __post_init__(self) -> None:
        IntScheme.__post_init__(self)
        if self.n_grid < 1 or not 0 <= self.max_shrink < 1:
            raise ValueError("n_grid must be >= 1 and max_shrink in [0, 1)")


def search_scales(weights: list[torch.Tensor], x: torch.Tensor, mean_abs: torch.Tensor, cfg: AWQConfig) -> torch.Tensor:
    """Best s [K] for the group's weights (each [N_i, K]) on input rows x [n, K]."""
    w = torch.cat(weights).float()  # [sum N, K]
    ref = x @ w.t()
    spec = cfg.spec(w.shape[1])
    best, best_s = float("inf"), torch.ones_like(mean_abs)
    for i in range(cfg.n_grid):
        s = mean_abs.clamp_min(1e-4).pow(i / cfg.n_grid)
        s = s / (s.max() * s.min()).sqrt()
        w_q = fake_quantize(w * s, spec) / s
        loss = (x @ w_q.t() - ref).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(weight: torch.Tensor, x: torch.Tensor, cfg: AWQConfig) -> torch.Tensor:
    """Per (row, group) clipping bound [N, G, 1] minimising the group-partial output error on rows x [n, K]."""
    spec = cfg.spec(weight.shape[1])
    n, k = weight.shape
    g = spec.group_size or k
    w = weight.float().view(n, k // g, g)
    xg = x.float().view(x.shape[0], k // g, g)  # [n, G, g]
    org_max = w.abs().amax(dim=-1, keepdim=True)  # [N, G, 1]
    best_max = org_max.clone()
    ref = torch.einsum("tgj,ngj->tng", xg, w)  # [n, N, G] partial outputs per group
    best_err = torch.full_like(org_max, float("inf"))
    for i in range(int(cfg.max_shrink * cfg.n_grid)):
        max_val = org_max * (1 - i / cfg.n_grid)
        clipped = torch.maximum(torch.minimum(w, max_val), -max_val).view(n, k)
        w_q = fake_quantize(clipped, spec).view(n, k // g, g)
        err = (torch.einsum("tgj,ngj->tng", xg, w_q) - ref).pow(2).mean(dim=0).unsqueeze(-1)  # [N, G, 1]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


@register_method(AWQConfig)
class AWQ(Method):
    needs = frozenset({NEEDS_STATS})

    def apply_layer(self, layer, prefix, inputs: dict[str, GroupInputs] | None):
        cfg = self.config
        for group in foldable_groups(layer):
            if all(cfg.ignores(f"{prefix}.{n}") for n in group.linears):
                continue
            fed = inputs[group.linears[0]]
            x = fed.samples[: cfg.max_search_rows]
            weights = [layer.get_submodule(n).weight for n in group.linears]
            s = search_scales(weights, x, fed.mean_abs, cfg)
            fold_scales(layer, group.producer, group.linears, s)
            if not cfg.clip:
                continue
            x_clip = (fed.samples[: cfg.max_clip_rows] / s)  # what feeds the scaled weights now
            for name in group.linears:
                if name.rsplit(".", 1)[-1] in CLIP_SKIP or cfg.ignores(f"{prefix}.{name}"):
                    continue
                lin = layer.get_submodule(name)
                bound = search_clip(lin.weight, x_clip, cfg)
                n, k = lin.weight.shape
                w = lin.weight.float().view(n, bound.shape[1], -1)
                set_tensor(lin, "weight", torch.maximum(torch.minimum(w, bound), -bound).view(n, k))
        return []
