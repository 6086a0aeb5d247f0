"""AWQ (Lin et al. 2024): protect salient weight channels by scaling them up before quantization. Per
linear group, search s = mean|x|^r (or mean|x|^r / mean|w|^(1-r)) over a grid of r for the smallest error at
the output of the block the group feeds (attention for q/k/v, the MLP for gate/up), fold s into the producer;
then search a per-group clipping range. A quantizer (RTN) follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import NEEDS_SEQUENCES, NEEDS_STATS, GroupInputs, Method, MethodConfig, register_method
from leanlm.compress.quantize.int_scheme import IntScheme
from leanlm.compress.transform.smoothing import fold_scales, foldable_groups, set_tensor
from leanlm.model.quantized.numerics import fake_quantize

CLIP_SKIP = ("q_proj", "k_proj")  # attention-score inputs: clipping them hurts (as in the AWQ reference)


@dataclass(frozen=True)
class AWQConfig(MethodConfig, IntScheme):
    n_grid: int = 20  # exponents r = 0, 1/n, ..., (n-1)/n tried for the scales
    # also search per-group clipping ranges. It helps SmolLM2 but hurts Qwen2.5-0.5B (W4 g64: KL 0.092 with it,
    # 0.080 without, RTN 0.085): it raises the error of the attention-sink token (position 0) where that
    # token's massive activation is made, which the per-group output error on sample rows does not see
    clip: bool = True
    max_shrink: float = 0.5  # clipping tries max |w| * (1 - i / n_grid) down to (1 - max_shrink)
    max_search_rows: int = 1024  # calibration rows used by the scale search (whole sequences for block_loss)
    max_clip_rows: int = 256  # and by the clipping search
    block_loss: bool = True  # score scales on the output of the block a group feeds, else on its own outputs
    duo_scaling: bool = False  # s = mean|x|^r / mean|w|^(1-r), w normalised per quantization group

    name = "awq"

    def __post_init__(self) -> None:
        IntScheme.__post_init__(self)
        if self.n_grid < 1 or not 0 <= self.max_shrink < 1:
            raise ValueError("n_grid must be >= 1 and max_shrink in [0, 1)")


def weight_mean(weights: list[torch.Tensor], cfg: AWQConfig) -> torch.Tensor:
    """mean over the group's rows of |w| / (its quantization group's max |w|) -> [K]: how large each input
    channel's weights are on their groups' grids (the weight half of the duo scales)."""
    w = torch.cat(weights).float()  # [sum N, K]
    spec = cfg.spec(w.shape[1])
    g = spec.group_size or w.shape[1]
    wg = w.abs().view(w.shape[0], -1, g)  # [sum N, G, g]
    return (wg / wg.amax(dim=-1, keepdim=True).clamp_min(1e-6)).view_as(w).mean(dim=0)


def candidate_scales(mean_abs: torch.Tensor, w_mean: torch.Tensor | None, r: float) -> torch.Tensor:
    """s [K] = mean|x|^r (/ mean|w|^(1-r) for duo scales), normalised so that max(s) * min(s) = 1."""
    s = mean_abs.clamp_min(1e-4).pow(r)
    if w_mean is not None:
        s = s / w_mean.clamp_min(1e-4).pow(1 - r)
    return s / (s.max() * s.min()).sqrt()


def search_scales(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    mean_abs: torch.Tensor,
    cfg: AWQConfig,
    w_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Best s [K] for the group's weights (each [N_i, K]) on input rows x [n, K], scored on the group's own
    outputs."""
    w = torch.cat(weights).float()  # [sum N, K]
    ref = x @ w.t()
    spec = cfg.spec(w.shape[1])
    best, best_s = float("inf"), torch.ones_like(mean_abs)
    for i in range(cfg.n_grid):
        s = candidate_scales(mean_abs, w_mean, i / cfg.n_grid)
        w_q = fake_quantize(w * s, spec) / s
        loss = (x @ w_q.t() - ref).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_block_scales(
    linears: list[nn.Linear],
    block: Callable[[], torch.Tensor],
    mean_abs: torch.Tensor,
    cfg: AWQConfig,
    w_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """Best s [K] for the group's `linears`, scored on block() [S, T, N] (the output of the attention / MLP
    block they feed, on fixed calibration sequences) with their weights swapped for Q(W * s) / s. Identity
    scales are a candidate too, so the result is never worse than plain rounding on those sequences."""
    ref = block()
    originals = [lin.weight for lin in linears]
    spec = cfg.spec(originals[0].shape[1])
    best, best_s = float("inf"), None
    candidates = [torch.ones_like(mean_abs)] + [
        candidate_scales(mean_abs, w_mean, i / cfg.n_grid) for i in range(cfg.n_grid)
    ]
    try:
        for s in candidates:
            for lin, w in zip(linears, originals):
                lin.weight = nn.Parameter((fake_quantize(w.float() * s, spec) / s).to(w.dtype), requires_grad=False)
            loss = (block() - ref).float().pow(2).mean().item()
            if loss < best:
                best, best_s = loss, s
    finally:
        for lin, w in zip(linears, originals):
            lin.weight = w
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
    needs = frozenset({NEEDS_STATS, NEEDS_SEQUENCES})

    def apply_layer(self, layer, prefix, inputs: dict[str, GroupInputs] | None):
        cfg = self.config
        for group in foldable_groups(layer):
            if all(cfg.ignores(f"{prefix}.{n}") for n in group.linears):
                continue
            fed = inputs[group.linears[0]]
            linears = [layer.get_submodule(n) for n in group.linears]
            w_mean = weight_mean([lin.weight for lin in linears], cfg) if cfg.duo_scaling else None
            if cfg.block_loss and fed.run is not None:  # an expert's rows are no whole sequences: scored alone
                module = layer.get_submodule(group.block)
                seqs = fed.sequences[: max(1, cfg.max_search_rows // fed.sequences.shape[1])]  # [S', T, K]
                s = search_block_scales(linears, lambda: fed.run(module, seqs), fed.mean_abs, cfg, w_mean)
            else:
                x = fed.samples[: cfg.max_search_rows]
                s = search_scales([lin.weight for lin in linears], x, fed.mean_abs, cfg, w_mean)
            fold_scales(layer, group.producer, group.linears, s)
            if not cfg.clip:
                continue
            x_clip = fed.samples[: cfg.max_clip_rows] / s  # what feeds the scaled weights now
            for name in group.linears:
                if name.rsplit(".", 1)[-1] in CLIP_SKIP or cfg.ignores(f"{prefix}.{name}"):
                    continue
                lin = layer.get_submodule(name)
                bound = search_clip(lin.weight, x_clip, cfg)
                n, k = lin.weight.shape
                w = lin.weight.float().view(n, bound.shape[1], -1)
                set_tensor(lin, "weight", torch.maximum(torch.minimum(w, bound), -bound).view(n, k))
        return []
