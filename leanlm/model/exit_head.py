"""Early-exit heads: what turns the residual stream after layer K into hidden states the shared LM head reads
(CALM, Schuster et al. 2022; LayerSkip, Elhoushi et al. 2024). leanlm.train.exits trains them on a frozen model;
self-speculation (`self:K`) drafts through the one at K."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.model.layers import Linear, RMSNorm


class ExitAdapter(nn.Module):
    """h + up(down(h)): a low-rank residual correction after the exit's norm. `up` starts at zero, so a fresh
    adapter is the identity (Kangaroo's adapter is a whole layer; this is the cheapest thing that can rotate)."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.down_proj = Linear(hidden_size, rank, bias=False)
        self.up_proj = Linear(rank, hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return h + self.up_proj(self.down_proj(h))


class ExitHead(nn.Module):
    """Residual stream x [..., hidden] after some layer -> what the LM head reads: its own RMSNorm, then the
    adapter when it has one."""

    def __init__(self, hidden_size: int, eps: float, adapter_rank: int = 0) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.adapter = ExitAdapter(hidden_size, adapter_rank) if adapter_rank else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h if self.adapter is None else self.adapter(h)

    @torch.no_grad()
    def reset_from(self, final_norm: RMSNorm) -> ExitHead:
        """Start equal to the untrained exit (the final norm, nothing more): norm weights copied, adapter's `up`
        zero and `down` small and random (a zero `down` as well would get no gradient)."""
        self.norm.weight.copy_(final_norm.weight)
        if self.adapter is not None:
            nn.init.normal_(self.adapter.down_proj.weight, std=self.adapter.down_proj.in_features**-0.5)
            self.adapter.up_proj.weight.zero_()
        return self


def build_exits(hidden_size: int, eps: float, layers: tuple[int, ...], adapter_rank: int) -> nn.ModuleDict:
    """One ExitHead per layer count, keyed by str(K): their weights are `model.exits.{K}.norm.weight` and
    `model.exits.{K}.adapter.{down,up}_proj.weight`."""
    return nn.ModuleDict({str(k): ExitHead(hidden_size, eps, adapter_rank) for k in layers})


# CALM's confidence measures: the engine's early exit decides with them, leanlm.train.exits calibrates them


def softmax_max(logits: torch.Tensor) -> torch.Tensor:
    """CALM's softmax response: the top probability of each row, logits [N, V] -> [N]."""
    return logits.float().softmax(dim=-1).amax(dim=-1)


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """The gap between each row's two largest probabilities, logits [N, V] -> [N]."""
    top = logits.float().softmax(dim=-1).topk(2, dim=-1).values  # [N, 2]
    return top[:, 0] - top[:, 1]


def saturation(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """CALM's hidden-state saturation: cosine similarity of each token's hidden state before and after a layer,
    [N, hidden] x2 -> [N] (near 1: the layer barely moved it)."""
    return F.cosine_similarity(before.float(), after.float(), dim=-1)
