"""Sparsity learned during training: masked fine-tuning, gradual magnitude pruning (Zhu & Gupta 2017),
iterative magnitude pruning with rewinding (Frankle & Carbin 2019), SR-STE (Zhou et al. 2021) and Top-KAST
(Jayakumar et al. 2020). leanlm.train.recipes names them (and act_sparse's TEAL training) for `leanlm train`.

Each method is a frozen config and a `SparseTraining` that puts a parametrization on every target linear's
weight: the forward sees `weight * keep`, and the method decides what gradient the dense weight gets back
(only the kept entries, every entry, or a larger set) and how its masks move between optimizer steps. At the
end `finish()` bakes the sparse weights into plain parameters and leaves the mask on each linear as
`sparsity_mask`, exactly as one-shot pruning does, so the same checkpoint writer (and the 2:4 packing) apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from leanlm.compress.base import MethodConfig
from leanlm.compress.prune.sparsity import SparsityScheme, lowest_mask, nm_mask
from leanlm.model.sparsity_mask import MASK_ATTR


@dataclass(frozen=True)
class MaskedConfig(MethodConfig, SparsityScheme):
    """Fine-tune a pruned model with its zeros held at zero (the mask is the weight's zeros at the start)."""

    name = "masked"


@dataclass(frozen=True)
class GMPConfig(MethodConfig, SparsityScheme):
    """Gradual magnitude pruning: sparsity rises on the cubic schedule s_t = s_f (1 - (1 - p)^3), p the
    progress from `start` to `end` (fractions of the run), re-pruning every `every` steps; for an N:M pattern
    the schedule prunes the lowest-magnitude entries of the final pattern's mask first."""

    name = "gmp"
    start: float = 0.0
    end: float = 0.75  # after this fraction of the steps the final sparsity holds; the rest fine-tunes
    every: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.start < self.end <= 1:
            raise ValueError(f"need 0 <= start < end <= 1 (fractions of the run), got {self.start}, {self.end}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1 step, got {self.every}")


@dataclass(frozen=True)
class RewindConfig(MethodConfig, SparsityScheme):
    """Iterative magnitude pruning with rewinding (Frankle & Carbin 2019): `rounds` prunings. The run is split
    into rounds + 1 equal parts; after part r of the first R, prune by magnitude to sparsity 1 - (1 - s)^(r / R)
    (each round removes the same share of what is left) and rewind the kept weights, and the optimizer, to the
    run's start: the pretrained weights, as Chen et al. 2020 do for BERT. The last part trains the final subnetwork
    (the "ticket"), so no pruning goes untrained."""

    name = "rewind"
    rounds: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass(frozen=True)
class SRSTEConfig(MethodConfig, SparsityScheme):
    """SR-STE: the N:M mask of |w| is taken again after every step; the dense weight gets the full
    straight-through gradient plus `decay` * w on its pruned entries (the sparse-refined term)."""

    name = "sr-ste"
    decay: float = 2e-4  # lambda_W of the paper

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nm is None:
            raise ValueError("SR-STE learns an N:M mask: pass pattern, e.g. '2:4' (Top-KAST or GMP for unstructured)")
        if self.decay < 0:
            raise ValueError(f"decay must be >= 0, got {self.decay}")


@dataclass(frozen=True)
class TopKASTConfig(MethodConfig, SparsityScheme):
    """Top-KAST: the forward keeps the top (1 - sparsity) of |w| per layer, the backward updates the top
    (1 - backward_sparsity), a larger set; weights outside the forward set pay `decay` / density more L2."""

    name = "top-kast"
    backward_sparsity: float = 0.3
    decay: float = 1e-4
    every: int = 4  # steps between mask refreshes

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nm is not None:
            raise ValueError("Top-KAST selects unstructured top-K sets; use SR-STE for an N:M pattern")
        if not 0 <= self.backward_sparsity < self.sparsity:
            raise ValueError(
                f"backward_sparsity must be in [0, sparsity={self.sparsity}) (the backward set is the larger one)"
            )
        if self.every < 1 or self.decay < 0:
            raise ValueError("need every >= 1 and decay >= 0")


# ----------------------------------------------------------------------------------------- the weight


class _SparseWeight(torch.autograd.Function):
    """forward: weight * keep. backward: the gradient on `grad_keep` (all entries when None: straight
    through), plus weight * decay_scale (a per-entry L2 term, None for none)."""

    @staticmethod
    def forward(ctx, weight, keep, grad_keep, decay_scale):
        ctx.save_for_backward(weight, keep, grad_keep, decay_scale)
        ctx.has = (grad_keep is not None, decay_scale is not None)
        return weight * keep

    @staticmethod
    def backward(ctx, grad):
        weight, keep, grad_keep, decay_scale = ctx.saved_tensors
        if ctx.has[0]:
            grad = grad * grad_keep
        if ctx.has[1]:
            grad = grad + weight * decay_scale
        return grad, None, None, None


class SparseParam(nn.Module):
    """The parametrization on one linear's weight; its masks are set by the SparseTraining that owns it."""

    def __init__(self, keep: torch.Tensor) -> None:
        super().__init__()
        self.keep = keep  # [N, K] bool: True where the forward uses the weight
        self.grad_keep: torch.Tensor | None = None  # where the weight gets gradient; None = everywhere
        self.decay_scale: torch.Tensor | None = None  # [N, K] float32 per-entry L2 coefficient, or None
        # Masks change only between optimizer steps, forwards run several times per step (gradient accumulation,
        # held-out loss): each mask's float copy is made once, while that mask tensor stays the same.
        self._float: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _as(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        mask = getattr(self, name)
        if mask is None:
            return None
        cached = self._float.get(name)
        if cached is None or cached[0] is not mask or cached[1].dtype != dtype:
            cached = self._float[name] = (mask, mask.to(dtype))
        return cached[1]

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        keep, grad_keep = self._as("keep", weight.dtype), self._as("grad_keep", weight.dtype)
        return _SparseWeight.apply(weight, keep, grad_keep, self.decay_scale)


def target_linears(model: nn.Module, config: MethodConfig) -> dict[str, nn.Linear]:
    """The decoder's float linears the config does not ignore (the head is ignored by default)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not parametrize.is_parametrized(m) and not config.ignores(name)
    }


def schedule_mask(scores: torch.Tensor, scheme: SparsityScheme, fraction: float) -> torch.Tensor:
    """Pruned mask [N, K] at `fraction` of the scheme's final sparsity: the lowest scores of the layer
    (unstructured), or the lowest of the entries the final N:M mask prunes (so fraction 1 is that mask)."""
    if scheme.nm is None:
        return lowest_mask(scores, scheme.sparsity * fraction, per_row=False)
    final = nm_mask(scores, *scheme.nm)
    if fraction >= 1:
        return final
    count = int(round(fraction * int(final.sum())))
    candidates = torch.where(final, scores, torch.full_like(scores, math.inf)).reshape(-1)
    mask = torch.zeros_like(candidates, dtype=torch.bool)
    if count:
        mask[torch.topk(candidates, count, largest=False).indices] = True
    return mask.view_as(scores)


# -------------------------------------------------------------------------------------- the methods


class SparseTraining:
    """Masks on the target linears for the length of a run. The trainer calls `attach` before building its
    optimizer, `refresh(step, total)` before the first step and after each optimizer step (True = the weights
    were rewound, reset the optimizer), and `finish` at the end."""

    def __init__(self, config: MethodConfig) -> None:
        self.config = config
        self.params: dict[str, SparseParam] = {}
        self.linears: dict[str, nn.Linear] = {}

    def attach(self, model: nn.Module) -> None:
        self.linears = target_linears(model, self.config)
        if not self.linears:
            raise ValueError(f"{self.config.name}: no linear to sparsify (check `ignore`)")
        for name, linear in self.linears.items():
            self.config.check_shape(linear.in_features)
            param = SparseParam(self.initial_keep(linear.weight.detach()))
            parametrize.register_parametrization(linear, "weight", param, unsafe=True)
            self.params[name] = param

    def dense(self, name: str) -> nn.Parameter:
        """The dense weight under linear `name`'s mask (what the optimizer updates)."""
        return self.linears[name].parametrizations.weight.original

    def initial_keep(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(weight, dtype=torch.bool)

    def refresh(self, step: int, total_steps: int) -> bool:
        return False

    def zero_pruned(self) -> None:
        """Hold the pruned entries of the dense weights at zero (the methods whose pruned weights get no
        gradient; AdamW's momentum would otherwise still move them)."""
        with torch.no_grad():
            for name, param in self.params.items():
                self.dense(name).mul_(param.keep)

    def finish(self) -> dict[str, float]:
        """Bake `weight * keep` into each linear, leave the mask as `sparsity_mask`; the final sparsity."""
        pruned = total = 0
        for name, linear in self.linears.items():
            keep = self.params[name].keep
            with torch.no_grad():
                weight = (self.dense(name) * keep).detach()
            parametrize.remove_parametrizations(linear, "weight", leave_parametrized=False)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            setattr(linear, MASK_ATTR, ~keep)
            pruned, total = pruned + int((~keep).sum()), total + keep.numel()
        self.params = {}
        return {"sparsity": pruned / max(total, 1)}

    def state_dict(self) -> dict:
        return {name: {"keep": p.keep, "grad_keep": p.grad_keep} for name, p in self.params.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, masks in state.items():
            self.params[name].keep, self.params[name].grad_keep = masks["keep"], masks["grad_keep"]
        self._after_load()

    def _after_load(self) -> None:  # noqa: B027 (methods with derived state rebuild it here)
        pass


class MaskedTraining(SparseTraining):
    def initial_keep(self, weight):
        return weight != 0

    def attach(self, model):
        super().attach(model)
        zeros = sum(int((~p.keep).sum()) for p in self.params.values())
        total = sum(p.keep.numel() for p in self.params.values())
        if zeros < 0.5 * self.config.sparsity * total:
            raise ValueError(
                f"masked fine-tuning keeps a pruned model's zeros, but only {zeros / total:.1%} of the weights are "
                "zero: prune first (leanlm prune), or train with gmp / sr-ste / top-kast"
            )
        for p in self.params.values():
            p.grad_keep = p.keep

    def refresh(self, step, total_steps):
        self.zero_pruned()
        return False


class GradualMagnitude(SparseTraining):
    def fraction(self, step: int, total_steps: int) -> float:
        """Share of the final sparsity at `step` on the cubic schedule."""
        cfg = self.config
        start, end = cfg.start * total_steps, max(cfg.end * total_steps, cfg.start * total_steps + 1)
        progress = min(max((step - start) / (end - start), 0.0), 1.0)
        return 1 - (1 - progress) ** 3

    def refresh(self, step, total_steps):
        last_prune = step >= self.config.end * total_steps and step - 1 < self.config.end * total_steps
        if step % self.config.every == 0 or last_prune:
            fraction = self.fraction(step, total_steps)
            for name, p in self.params.items():
                scores = (self.dense(name).detach() * p.keep).abs()  # pruned entries stay pruned
                p.keep = ~schedule_mask(scores, self.config, fraction) & p.keep
                p.grad_keep = p.keep
        self.zero_pruned()
        return False


class Rewinding(SparseTraining):
    def attach(self, model):
        super().attach(model)
        self.start = {name: self.dense(name).detach().clone() for name in self.params}
        for p in self.params.values():
            p.grad_keep = p.keep

    def refresh(self, step, total_steps):
        rounds, total = self.config.rounds, max(total_steps, 1)
        done = min(step * (rounds + 1) // total, rounds)  # prunings due after `step` steps
        before = min((step - 1) * (rounds + 1) // total, rounds) if step else 0
        if done == before:
            self.zero_pruned()
            return False
        # each round prunes the same share of what is left: (1 - s)^(done / rounds) of the weights survive
        fraction = (1 - (1 - self.config.sparsity) ** (done / rounds)) / self.config.sparsity
        with torch.no_grad():
            for name, p in self.params.items():
                scores = (self.dense(name) * p.keep).abs()
                p.keep = ~schedule_mask(scores, self.config, fraction) & p.keep
                p.grad_keep = p.keep
                self.dense(name).copy_(self.start[name] * p.keep)
        self.zero_pruned()
        return True

    def state_dict(self):
        return {"masks": super().state_dict(), "start": self.start}

    def load_state_dict(self, state):
        self.start = state["start"]
        super().load_state_dict(state["masks"])


class SRSTE(SparseTraining):
    def initial_keep(self, weight):
        return ~nm_mask(weight.abs(), *self.config.nm)

    def refresh(self, step, total_steps):
        for name, p in self.params.items():
            p.keep = ~nm_mask(self.dense(name).detach().abs(), *self.config.nm)
            p.decay_scale = (~p.keep).float() * self.config.decay if self.config.decay else None
        return False

    def _after_load(self):
        self.refresh(0, 1)


class TopKAST(SparseTraining):
    def initial_keep(self, weight):
        return ~lowest_mask(weight.abs(), self.config.sparsity, per_row=False)

    def refresh(self, step, total_steps):
        if step % self.config.every:
            return False
        cfg = self.config
        density = 1 - cfg.sparsity
        for name, p in self.params.items():
            scores = self.dense(name).detach().abs()
            p.keep = ~lowest_mask(scores, cfg.sparsity, per_row=False)
            p.grad_keep = ~lowest_mask(scores, cfg.backward_sparsity, per_row=False)
            # L2 on the forward set, and 1/density as much on the explored-only set (the paper's regulariser)
            p.decay_scale = cfg.decay * (p.keep.float() + (p.grad_keep & ~p.keep).float() / density)
        return False

    def _after_load(self):
        self.refresh(0, 1)
