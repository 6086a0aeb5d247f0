"""Channel permutation for N:M sparsity (Pool & Yu 2021): reorder a linear's input channels so that the N:M
groups (runs of m consecutive inputs) hold weights that prune well together, and fold the order into the
layers that produce those inputs, so the model computes exactly what it did before pruning.

Where an order can be folded (a transform placed before the pruner in the recipe):
- the MLP's intermediate channels: gate/up output rows and down_proj input columns, one order per layer;
- each KV head's value channels: v_proj output rows of that head and the o_proj input columns of every query
  head reading it, one order per KV head (GQA shares it over the group);
- the residual stream (`hidden=True`): one order for the whole model, applied to the embedding, every norm,
  the q/k/v/gate/up input columns, the o_proj/down_proj output rows and the head (RMSNorm commutes with it).

The search maximises the score kept under N:M, sum over rows of the n largest of each group of m scores: each
round pairs every group with another at random and applies, per pair, the best of the m x m swaps of one
column between the two groups (pairs are disjoint, so the gains add), until `patience` rounds gain nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import NEEDS_STATS, GroupInputs, Method, MethodConfig, register_method
from leanlm.compress.prune.sparsity import parse_pattern, wanda_scores
from leanlm.compress.transform.smoothing import set_tensor

SCORES = ("magnitude", "wanda")
_MAX_HIDDEN_ROWS = 8192  # score rows the residual-stream search samples (it spans every layer's matrices)


@dataclass(frozen=True)
class PermuteConfig(MethodConfig):
    pattern: str = "2:4"  # the N:M pattern the pruner after it will use
    score: str = "magnitude"  # what the pruner ranks by: |W|, or Wanda's |W| * ||X_j|| (per-layer orders)
    hidden: bool = True  # also reorder the residual stream (one order for the model, scored by |W|)
    max_rounds: int = 100
    patience: int = 5  # rounds without gain before the search stops
    seed: int = 0

    name = "permute"

    def __post_init__(self) -> None:
        parse_pattern(self.pattern)
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.max_rounds < 0 or self.patience < 1:
            raise ValueError("need max_rounds >= 0 and patience >= 1")


# ------------------------------------------------------------------------------------------------ search


def kept_score(scores: torch.Tensor, n: int, m: int) -> float:
    """sum over rows of the n largest of each run of m scores: scores [R, K] (K % m == 0)."""
    rows, k = scores.shape
    return scores.reshape(rows, k // m, m).topk(n, dim=-1).values.sum().item()


def search_permutation(
    scores: torch.Tensor, n: int, m: int, max_rounds: int = 400, patience: int = 25, seed: int = 0
) -> torch.Tensor:
    """An order of the columns of scores [R, K] keeping more of them under n:m: perm [K] with column j of the
    reordered matrix = column perm[j], on the CPU (CPU indices index tensors on any device). Never keeps less
    than the identity. The search runs on the scores' device."""
    rows, k = scores.shape
    device = scores.device
    if k % m:
        raise ValueError(f"{k} columns do not split into groups of {m}")
    groups = k // m
    perm = torch.arange(k, device=device)
    if groups < 2:
        return perm.cpu()
    gen = torch.Generator().manual_seed(seed)
    s = scores.float().t().contiguous()  # [K, R]: a column's scores, gathered by index below
    a_idx, b_idx = torch.meshgrid(torch.arange(m, device=device), torch.arange(m, device=device), indexing="ij")
    a_idx, b_idx = a_idx.flatten(), b_idx.flatten()  # the m*m swaps: column a of group A <-> column b of B
    idle = 0
    for _ in range(max_rounds):
        order = torch.randperm(groups, generator=gen)[: groups // 2 * 2].view(-1, 2).to(device)  # disjoint pairs [P, 2]
        cols = perm.view(groups, m)[order]  # [P, 2, m] input channels now in each pair's two groups
        gain, best = _best_swaps(s, cols, n, a_idx, b_idx)
        improve = gain > 1e-6 * (1 + gain.abs().max())
        if not improve.any():
            idle += 1
            if idle >= patience:
                break
            continue
        idle = 0
        p = order[improve]  # [P', 2] group ids
        sa, sb = a_idx[best[improve]], b_idx[best[improve]]
        pos_a, pos_b = p[:, 0] * m + sa, p[:, 1] * m + sb
        perm[pos_a], perm[pos_b] = perm[pos_b].clone(), perm[pos_a].clone()
    return perm.cpu()


def _without_each(vals: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For groups vals [p, m, R] and each member i: (kept score of the group without i) - (kept score of the
    group) [p, m, R], and the n-th largest of the group without i [p, m, R] (what a newcomer must beat)."""
    top, order = vals.sort(dim=1, descending=True)  # [p, m, R]
    rank = order.argsort(dim=1)  # member i's place in the order
    in_top = rank < n
    # without a top-n member the (n+1)-th moves up; without any other member nothing changes
    loss = torch.where(in_top, top[:, n : n + 1] - vals, torch.zeros_like(vals))
    nth = torch.where(in_top, top[:, n : n + 1], top[:, n - 1 : n]).expand_as(vals)
    return loss, nth


def _best_swaps(s, cols, n, a_idx, b_idx, chunk: int = 128):
    """For each pair of groups cols [P, 2, m]: the gain in kept score of its best single swap, and which.

    Putting x into a group in place of member i keeps (kept without i) + max(0, x - (n-th largest without i)),
    so each of the m x m swaps costs a sum over rows of two ReLUs, with no sort of the swapped groups."""
    gains, bests = [], []
    for c in range(0, cols.shape[0], chunk):
        grp = cols[c : c + chunk]  # [p, 2, m]
        va, vb = s[grp[:, 0]], s[grp[:, 1]]  # [p, m, R] each
        loss_a, nth_a = _without_each(va, n)
        loss_b, nth_b = _without_each(vb, n)
        # swap (i, j): b_j enters A in place of a_i, a_i enters B in place of b_j -> [p, m(i), m(j)]
        enter_a = (vb.unsqueeze(1) - nth_a.unsqueeze(2)).clamp_min(0).sum(-1)
        enter_b = (va.unsqueeze(2) - nth_b.unsqueeze(1)).clamp_min(0).sum(-1)
        gain = loss_a.sum(-1).unsqueeze(2) + loss_b.sum(-1).unsqueeze(1) + enter_a + enter_b
        g, b = gain.flatten(1).max(dim=1)
        gains.append(g)
        bests.append(b)
    return torch.cat(gains), torch.cat(bests)


# ------------------------------------------------------------------------------------------------ folding


def permute_rows(module: nn.Module, perm: torch.Tensor, rows: slice | None = None) -> None:
    """Reorder a linear's output rows (and bias), all of them or those in `rows` (perm indexes within them)."""
    for name in ("weight", "bias"):
        t = getattr(module, name, None)
        if t is None:
            continue
        new = t.detach().clone()
        if rows is None:
            new = new[perm]
        else:
            new[rows] = t.detach()[rows][perm]
        set_tensor(module, name, new)


def permute_columns(module: nn.Module, perm: torch.Tensor, cols: slice | None = None) -> None:
    w = module.weight.detach()
    new = w[:, perm] if cols is None else w.clone()
    if cols is not None:
        new[:, cols] = w[:, cols][:, perm]
    set_tensor(module, "weight", new)


def fold_hidden(model: nn.Module, perm: torch.Tensor) -> None:
    """Reorder the residual stream everywhere it is read or written (see the module docstring)."""
    inner = model.model
    set_tensor(inner.embed_tokens, "weight", inner.embed_tokens.weight.detach()[:, perm])
    if model.config.tie_word_embeddings:  # one tensor, as build_model ties them
        model.lm_head.weight = inner.embed_tokens.weight
    else:
        permute_columns(model.lm_head, perm)
    set_tensor(inner.norm, "weight", inner.norm.weight.detach()[perm])
    for layer in inner.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            set_tensor(norm, "weight", norm.weight.detach()[perm])
        for name in ("q_proj", "k_proj", "v_proj"):
            permute_columns(getattr(layer.self_attn, name), perm)
        for name in ("gate_proj", "up_proj"):
            permute_columns(getattr(layer.mlp, name), perm)
        permute_rows(layer.self_attn.o_proj, perm)
        permute_rows(layer.mlp.down_proj, perm)


def fold_intermediate(layer: nn.Module, perm: torch.Tensor) -> None:
    permute_rows(layer.mlp.gate_proj, perm)
    permute_rows(layer.mlp.up_proj, perm)
    permute_columns(layer.mlp.down_proj, perm)


def fold_values(layer: nn.Module, kv_head: int, perm: torch.Tensor, head_dim: int, heads_per_kv: int) -> None:
    """Reorder KV head `kv_head`'s value channels: its v_proj rows and each of its query heads' o_proj columns."""
    permute_rows(layer.self_attn.v_proj, perm, slice(kv_head * head_dim, (kv_head + 1) * head_dim))
    for h in range(kv_head * heads_per_kv, (kv_head + 1) * heads_per_kv):
        permute_columns(layer.self_attn.o_proj, perm, slice(h * head_dim, (h + 1) * head_dim))


# ------------------------------------------------------------------------------------------------ method


@dataclass(frozen=True)
class PermuteReport:
    """Score kept under the pattern before and after reordering, per place an order was searched."""

    place: str  # "hidden", "model.layers.3.mlp.down_proj", "model.layers.3.self_attn.o_proj[kv 1]"
    kept_before: float
    kept_after: float


@register_method(PermuteConfig)
class Permute(Method):
    def __init__(self, config: PermuteConfig) -> None:
        super().__init__(config)
        self.needs = frozenset({NEEDS_STATS}) if config.score == "wanda" else frozenset()  # Wanda's input norms
        self.reports: list[PermuteReport] = []

    def _plain(self, *modules: nn.Module) -> bool:
        """Reordering needs float linears (a quantized layer's codes are laid out for its kernels)."""
        return all(isinstance(mod, nn.Linear) for mod in modules)

    def _search(self, place: str, scores: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        n, m = parse_pattern(cfg.pattern)
        perm = search_permutation(scores, n, m, cfg.max_rounds, cfg.patience, cfg.seed)
        self.reports.append(PermuteReport(place, kept_score(scores, n, m), kept_score(scores[:, perm], n, m)))
        return perm

    def begin(self, model: nn.Module) -> None:
        self.reports = []
        if not self.config.hidden:
            return
        readers = [
            getattr(parent, name)
            for layer in model.model.layers
            for parent, names in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                (layer.mlp, ("gate_proj", "up_proj")),
            )
            for name in names
        ]
        if not self._plain(*readers, *(lay.self_attn.o_proj for lay in model.model.layers)):
            raise ValueError("channel permutation reorders float linears: put PermuteConfig before any quantizer")
        scores = torch.cat([r.weight.detach().abs().float() for r in readers])  # [R, hidden]
        gen = torch.Generator().manual_seed(self.config.seed)
        sample = scores[torch.randperm(scores.shape[0], generator=gen)[:_MAX_HIDDEN_ROWS]]
        perm = self._search("hidden", sample)
        fold_hidden(model, perm)

    def _scores(self, linear: nn.Module, inputs: GroupInputs | None) -> torch.Tensor:
        if self.config.score == "wanda" and inputs is not None:
            return wanda_scores(linear.weight, inputs.mean_sq)
        return linear.weight.detach().abs().float()

    def apply_layer(self, layer, prefix, inputs):
        mlp, attn = layer.mlp, layer.self_attn
        if not self._plain(mlp.gate_proj, mlp.up_proj, mlp.down_proj, attn.v_proj, attn.o_proj):
            raise ValueError("channel permutation reorders float linears: put PermuteConfig before any quantizer")
        fed = inputs or {}
        down = self._scores(mlp.down_proj, fed.get("mlp.down_proj"))
        fold_intermediate(layer, self._search(f"{prefix}.mlp.down_proj", down))
        o_scores = self._scores(attn.o_proj, fed.get("self_attn.o_proj"))  # [hidden, heads * D]
        d, n_heads, n_kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        per_kv = n_heads // n_kv
        if d % parse_pattern(self.config.pattern)[1]:
            return []
        for g in range(n_kv):
            block = torch.cat([o_scores[:, h * d : (h + 1) * d] for h in range(g * per_kv, (g + 1) * per_kv)])
            fold_values(layer, g, self._search(f"{prefix}.self_attn.o_proj[kv {g}]", block), d, per_kv)
        return []

    def summary(self) -> dict[str, float]:
        """Relative gain of the score kept under the pattern, per kind of place (hidden, down_proj, o_proj)."""
        totals: dict[str, list[float]] = {}
        for r in self.reports:
            kind = "hidden" if r.place == "hidden" else r.place.split(".")[-1].split("[")[0]
            before, after = totals.setdefault(kind, [0.0, 0.0])
            totals[kind] = [before + r.kept_before, after + r.kept_after]
        return {kind: after / before - 1 if before else math.nan for kind, (before, after) in totals.items()}
