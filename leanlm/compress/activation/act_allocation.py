"""TEAL's block-level greedy allocation (Liu et al. 2024): how much of each linear's input a decoder layer
zeroes, chosen on the layer's own output. Starting from dense, each step tries raising every linear's sparsity
by one level, runs the layer on a few calibration sequences with that change, and keeps the change whose error
on the layer's output grows least per weight byte it stops reading, until the layer's bytes-weighted sparsity
reaches the target. The error is |y - y_dense|^2 / |y_dense - x|^2: against what the layer adds to the residual
stream, not against the stream itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.model.forward import decoder_layer

BLOCK_SEQUENCES = 2  # calibration sequences the layer runs on per trial (each trial is one layer forward)


@dataclass
class Candidate:
    """One linear the allocation may sparsify."""

    linear: nn.Module
    scale: torch.Tensor  # [K] float32: the score is |x| * scale
    thresholds: list[float]  # the score's threshold at each sparsity level (on the calibration inputs)


@torch.no_grad()
def block_levels(
    layer: nn.Module,
    hidden: torch.Tensor,
    rope,
    candidates: dict[str, Candidate],
    levels: list[float],
    target: float,
) -> dict[str, float]:
    """name -> the sparsity level chosen for it (one of `levels`, increasing from 0); hidden [S', T, d]: the
    sequences each trial runs the layer on."""
    reference = decoder_layer(layer, hidden, rope)
    added = (reference - hidden).pow(2).sum().clamp_min(1e-30)
    level = dict.fromkeys(candidates, 0)

    def sparsify(name: str):
        c = candidates[name]

        def hook(_, args):
            x = args[0]
            return (x.masked_fill(x.abs() * c.scale <= c.thresholds[level[name]], 0), *args[1:])

        return hook

    handles = [c.linear.register_forward_pre_hook(sparsify(name)) for name, c in candidates.items()]
    try:

        def error() -> float:
            return float((decoder_layer(layer, hidden, rope) - reference).pow(2).sum() / added)

        sizes = {name: c.linear.weight.numel() for name, c in candidates.items()}
        total, done, current = sum(sizes.values()), 0.0, error()
        while done < target * total - 1e-9:
            best = None
            for name in candidates:
                if level[name] + 1 >= len(levels):
                    continue
                level[name] += 1
                trial = error()
                level[name] -= 1
                cost = (trial - current) / ((levels[level[name] + 1] - levels[level[name]]) * sizes[name])
                if best is None or cost < best[0]:
                    best = (cost, name, trial)
            if best is None:
                break
            _, name, current = best
            done += (levels[level[name] + 1] - levels[level[name]]) * sizes[name]
            level[name] += 1
    finally:
        for handle in handles:
            handle.remove()
    return {name: levels[i] for name, i in level.items()}
