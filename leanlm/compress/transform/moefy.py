"""MoEfication (Zhang et al. 2022, "Transformer Feed-forward Layers are Mixtures of Experts"): each layer's dense
SwiGLU FFN becomes E experts that partition its intermediate neurons (expert_split.py), plus a router that picks
the top-k experts per token; every chosen expert counts 1, so top-k = E is the dense model exactly.

The router is MoEfication's (an expert-selection predictor fitted to the dense FFN's own activations on calibration
text, after the split), not the Scaling Transformer's sparse FFN controller, which is a low-rank controller trained
jointly with the model from scratch: here nothing is trained, the FFN weights are kept as they were, and the router
only learns to predict which experts the dense FFN would use. The paper trains a small MLP with a classification
loss; we fit one linear map [E, hidden] in closed form (ridge least squares from the FFN input to each expert's
activation norm, or its log), because the router must be a plain `Router` weight and a closed form is seconds on a
CPU. The "centroid" router (each expert's mean gate_proj row) needs no data: the paper's similarity baseline.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import NEEDS_STATS, GroupInputs, LinearReport, Method, MethodConfig, register_method
from leanlm.compress.transform.expert_split import SPLITS, intermediate, split_neurons
from leanlm.config.moe import MoEConfig
from leanlm.model.layers import Linear
from leanlm.model.llama import layer_groups
from leanlm.model.mlp import LlamaMLP
from leanlm.model.moe import SparseMoeBlock

ROUTERS = ("ridge", "centroid")
# what the ridge router is fitted to predict per token and expert: log of the expert's activation norm (ranks the
# experts as the norm does, but its errors weigh small and large tokens alike: 0.3-4 points more recall of the
# oracle's top-k on SmolLM2's held-out calibration tokens), or the norm itself
TARGETS = ("log_norm", "norm")


@dataclass(frozen=True)
class MoefyConfig(MethodConfig):
    num_experts: int = 16  # E: each expert holds intermediate_size / E of the FFN's neurons
    top_k: int = 4  # experts run per token (4 of 16: a quarter of the FFN's parameters)
    split: str = "coactivation"  # cluster neurons by calibration activation pattern, or by gate_proj weights
    # ridge: least squares from the FFN input to each expert's activation norm on calibration tokens (MoEfication's
    # learned predictor, linear); centroid: each expert's mean gate_proj row, no data (the paper's similarity one)
    router: str = "ridge"
    target: str = "log_norm"  # one of TARGETS
    ridge: float = 1e-2  # the ridge penalty, as a fraction of the inputs' mean squared norm
    kmeans_iters: int = 15  # rounds of balanced k-means at most
    # neurons kept out of the experts in an always-on shared expert (DeepSeek-MoE's shared expert; here the ones with
    # the largest mean squared activation on the calibration tokens); 0: none. The rest split into the E experts.
    shared_neurons: int = 0
    seed: int = 0  # of k-means' initial centroids

    name = "moefy"

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.shared_neurons < 0:
            raise ValueError(f"shared_neurons must be >= 0, got {self.shared_neurons}")
        if self.ridge < 0 or self.kmeans_iters < 1:
            raise ValueError(f"need ridge >= 0 and kmeans_iters >= 1, got {self.ridge} and {self.kmeans_iters}")

    @property
    def needs_data(self) -> bool:
        return self.split == "coactivation" or self.router == "ridge" or self.shared_neurons > 0


# ------------------------------------------------------------------------------------------------ routers


def expert_norms(acts: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
    """[n, E]: the L2 norm of each expert's share of the intermediate activations acts [n, I]."""
    return torch.stack([acts[:, idx].norm(dim=1) for idx in groups], dim=1)


def ridge_router(x: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """Router weight [E, hidden]: argmin_W |x W^T - targets|^2 + lam |W|^2 over x [n, hidden], targets [n, E],
    lam = ridge * mean |x|^2 (scale-free). No intercept (the Router has none): RMSNorm outputs carry large, nearly
    constant channels that play its part."""
    x, y = x.double(), targets.double()
    gram = x.T @ x  # [hidden, hidden]
    lam = ridge * float(gram.diagonal().sum()) / x.shape[0]
    w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), x.T @ y)  # [hidden, E]
    return w.T


def centroid_router(gate: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
    """Router weight [E, hidden]: each expert's mean gate_proj row, so a score is the mean pre-activation of the
    expert's gates (large when many of its neurons open)."""
    return torch.stack([gate[idx].double().mean(0) for idx in groups])


# ------------------------------------------------------------------------------------------------ experts


def moe_block(
    mlp: LlamaMLP, groups: list[torch.Tensor], router: torch.Tensor, model_config, shared: torch.Tensor | None = None
) -> SparseMoeBlock:
    """The SparseMoeBlock whose expert e holds neurons groups[e] of `mlp` (gate/up rows, down columns), whose shared
    expert holds neurons `shared` (when the config has one) and whose router weight is `router` [E, hidden]; in the
    MLP's dtype and device."""
    weight = mlp.gate_proj.weight
    with torch.device("meta"):
        block = SparseMoeBlock(model_config)
    state = {"gate.weight": router.to(weight.dtype)}
    names = [f"experts.{e}" for e in range(len(groups))] + (["shared_expert"] if shared is not None else [])
    for name, idx in zip(names, [*groups, *([shared] if shared is not None else [])], strict=True):
        idx = idx.to(weight.device)
        state[f"{name}.gate_proj.weight"] = mlp.gate_proj.weight.detach()[idx].clone()
        state[f"{name}.up_proj.weight"] = mlp.up_proj.weight.detach()[idx].clone()
        state[f"{name}.down_proj.weight"] = mlp.down_proj.weight.detach()[:, idx].contiguous()
    block.load_state_dict({k: v.to(weight.device) for k, v in state.items()}, assign=True)
    return block.requires_grad_(mlp.gate_proj.weight.requires_grad)


def _float_mlp(layer: nn.Module, prefix: str) -> LlamaMLP:
    mlp = layer.mlp
    if not isinstance(mlp, LlamaMLP):
        raise ValueError(f"{prefix}.mlp is a {type(mlp).__name__}: MoEfication splits a dense SwiGLU MLP")
    for name in ("gate_proj", "up_proj", "down_proj"):
        if type(getattr(mlp, name)) not in (nn.Linear, Linear):
            raise ValueError(
                f"{prefix}.mlp.{name} is a {type(getattr(mlp, name)).__name__}: MoEfication splits float weights, "
                "so put MoefyConfig before any quantizer or pruner in the recipe"
            )
    return mlp


class OracleGate(nn.Module):
    """A stand-in router whose logits [T, E] are each expert's true activation norm on the token: top-k then picks
    the experts the dense FFN uses most (the upper bound of any router over this split). Holds the experts without
    registering them, so the block's state dict is unchanged."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self._experts = tuple(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = []
        for expert in self._experts:
            act = torch.nn.functional.silu(expert.gate_proj(x)) * expert.up_proj(x)  # [T, I / E]
            cols.append(act.float().norm(dim=-1))
        return torch.stack(cols, dim=-1)


@contextlib.contextmanager
def oracle_routing(model: nn.Module) -> Iterator[None]:
    """Inside, every SparseMoeBlock of `model` routes by OracleGate; its own routers come back on exit."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    saved = [b.gate for b in blocks]
    for block in blocks:
        block.gate = OracleGate(block.experts)
    try:
        yield
    finally:
        for block, gate in zip(blocks, saved, strict=True):
            block.gate = gate


# ------------------------------------------------------------------------------------------------ method


@register_method(MoefyConfig)
class MoEfication(Method):
    def __init__(self, config: MoefyConfig) -> None:
        super().__init__(config)
        self.model_config = None
        self.stats: dict[str, list[float]] = {}

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]  (a config-dependent NEEDS_*)
        return frozenset({NEEDS_STATS}) if self.config.needs_data else frozenset()

    def begin(self, model: nn.Module) -> None:
        cfg, config = self.config, model.config
        if config.moe is not None:
            raise ValueError("the model already has experts (config.moe is set): MoEfication splits a dense model")
        width = config.intermediate_size - cfg.shared_neurons  # the routed neurons
        if width < cfg.num_experts or width % cfg.num_experts:
            fits = [e for e in range(2, 65) if width % e == 0]
            raise ValueError(
                f"intermediate_size {config.intermediate_size} less {cfg.shared_neurons} shared neurons does not "
                f"split into {cfg.num_experts} equal experts; try {fits}"
            )
        moe = MoEConfig(cfg.num_experts, cfg.top_k, width // cfg.num_experts, scoring="ones",
                        shared_expert_intermediate_size=cfg.shared_neurons)  # fmt: skip
        self.model_config = dataclasses.replace(config, moe=moe)
        model.config = self.model_config

    def apply_layer(self, layer, prefix, inputs: dict[str, GroupInputs] | None) -> list[LinearReport]:
        cfg = self.config
        mlp = _float_mlp(layer, prefix)
        gate, up = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()
        x = None if inputs is None else inputs["mlp.gate_proj"].samples  # [n, hidden] float32
        if x is None and cfg.needs_data:
            raise ValueError(f"MoefyConfig(split={cfg.split!r}, router={cfg.router!r}) needs calibration samples")
        acts = None if x is None else intermediate(x, gate, up).cpu()  # [n, I] float64
        shared, routed = None, torch.arange(gate.shape[0])
        if cfg.shared_neurons:  # the busiest neurons on average go to the shared expert; the rest are routed
            busy = torch.zeros(gate.shape[0], dtype=torch.bool)
            busy[acts.pow(2).mean(0).topk(cfg.shared_neurons).indices] = True
            shared, routed = torch.nonzero(busy).flatten(), torch.nonzero(~busy).flatten()
        routed_acts = None if acts is None else acts[:, routed]
        groups = split_neurons(cfg.split, cfg.num_experts, gate.cpu()[routed], routed_acts, cfg.kmeans_iters, cfg.seed)
        groups = [routed[g] for g in groups]  # indices into the whole FFN
        norms = None if acts is None else expert_norms(acts, groups)  # [n, E]
        if cfg.router == "ridge":
            targets = norms.clamp_min(1e-6).log() if cfg.target == "log_norm" else norms
            router = ridge_router(x.cpu(), targets, cfg.ridge)
        else:
            router = centroid_router(gate.cpu(), groups)
        if acts is not None:
            self._record(x.cpu().double() @ router.T, norms, acts)
        layer.mlp = moe_block(mlp, groups, router, self.model_config, shared)
        layer.linear_groups = layer_groups(self.model_config, sparse=True)  # later methods see the experts
        return []

    def _record(self, scores: torch.Tensor, norms: torch.Tensor, acts: torch.Tensor) -> None:
        """How well the router's top-k (scores [n, E]) matches the oracle's (norms [n, E]) on the calibration
        tokens it was fitted on (the mass: of the routed neurons), and how sparse the dense activations acts [n, I]
        are."""
        k = self.config.top_k
        chosen, best = scores.topk(k, dim=1).indices, norms.topk(k, dim=1).indices
        mass = norms.pow(2)  # [n, E]: each expert's squared activation norm
        total = mass.sum(1)
        hits = (chosen[:, :, None] == best[:, None, :]).any(-1).double().mean()
        rms = acts.pow(2).mean().sqrt()
        top_neurons = acts.pow(2).sort(dim=1, descending=True).values.cumsum(1) / acts.pow(2).sum(1, keepdim=True)
        for key, value in {
            "router recall of oracle top-k": hits,
            "activation mass kept (router)": (mass.gather(1, chosen).sum(1) / total).mean(),
            "activation mass kept (oracle)": (mass.gather(1, best).sum(1) / total).mean(),
            "activations below 0.1 x RMS": (acts.abs() < 0.1 * rms).double().mean(),
            "neurons holding 90% of the mass": (top_neurons < 0.9).double().sum(1).add(1).mean() / acts.shape[1],
        }.items():
            self.stats.setdefault(key, []).append(float(value))

    def summary(self) -> dict:
        """Means over layers, on the calibration tokens (in-sample for the ridge router)."""
        return {k: sum(v) / len(v) for k, v in self.stats.items()}


def set_top_k(model: nn.Module, top_k: int) -> None:
    """Run `top_k` experts per token in every SparseMoeBlock of a MoEfied model from now on (the router is the same
    for any k, so one split serves every budget); the model's config follows, so a checkpoint saves the new k."""
    moe = model.config.moe
    if moe is None or not 1 <= top_k <= moe.num_experts:
        raise ValueError(f"top_k must be in [1, num_experts] of a model with experts; got {top_k} for {moe}")
    model.config = dataclasses.replace(model.config, moe=dataclasses.replace(moe, top_k=top_k))
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block.moe = dataclasses.replace(block.moe, top_k=top_k)
