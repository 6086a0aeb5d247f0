"""Sparse upcycling (Komatsuzaki et al. 2022): every dense MLP becomes E copies of itself behind a fresh router, so
the MoE computes exactly what the dense model did until training moves the copies apart; and PR-MoE (Rajbhandari et
al. 2022, DeepSpeed-MoE's residual MoE): the dense MLP kept on every token as a shared expert, plus E experts at
top-1 that start adding nothing (or half each, see UpcycleConfig.residual_init).

A transform: it rewrites the MLPs and `ModelConfig.moe` before the layer loop; train it after with `leanlm train
--upcycle-experts E` (leanlm.train adds the Switch load-balancing loss for MoE models).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import Method, MethodConfig, register_method
from leanlm.config.moe import MoEConfig
from leanlm.model.layers import Linear
from leanlm.model.llama import layer_groups
from leanlm.model.mlp import LlamaMLP
from leanlm.model.moe import SparseMoeBlock

RESIDUAL_INITS = ("zero", "half")
SAVE_AS = ("auto", "mixtral", "source")


@dataclass(frozen=True)
class UpcycleConfig(MethodConfig):
    num_experts: int = 8  # E copies of each dense MLP
    top_k: int | None = None  # experts per token; None: 2, or 1 with residual (PR-MoE's "dense MLP + one expert")
    # PR-MoE: the dense MLP stays as an ungated shared expert beside the routed ones
    residual: bool = False
    # how PR-MoE keeps the dense output at initialisation: "zero" - the routed experts are copies of the dense MLP
    # with down_proj zero (they add nothing until trained); "half" - the shared expert and every routed copy carry
    # half the dense down_proj (the chosen experts' weights sum to 1, so the halves add back to the dense MLP)
    residual_init: str = "zero"
    router_std: float | None = None  # std of the router's normal init; None: sqrt(0.1 / hidden) (Switch's scale)
    router_aux_loss_coef: float = 0.01  # Switch's load-balancing loss weight, which leanlm.train applies
    layers: tuple[int, ...] | None = None  # the layers to upcycle; None: every layer (Switch: every other one)
    # the saved architecture: "mixtral" (HF's MixtralForCausalLM loads it; plain upcycling of a bias-free llama
    # over every layer), "source" (the dense model's llama / qwen2 with a leanlm_moe block), "auto": mixtral where
    # it can express the model, else source
    save_as: str = "auto"
    seed: int = 0  # of the routers' initialisation

    name = "upcycle"

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {self.num_experts!r}")
        if self.top_k is not None and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.residual_init not in RESIDUAL_INITS:
            raise ValueError(f"residual_init must be one of {', '.join(RESIDUAL_INITS)}, got {self.residual_init!r}")
        if self.save_as not in SAVE_AS:
            raise ValueError(f"save_as must be one of {', '.join(SAVE_AS)}, got {self.save_as!r}")
        if self.router_std is not None and not self.router_std >= 0:
            raise ValueError(f"router_std must be >= 0 (or None for Switch's scale), got {self.router_std}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(int(i) for i in self.layers))))
            if not self.layers or min(self.layers) < 0:
                raise ValueError(f"layers must name layer indices >= 0 (None: every layer), got {self.layers}")
        if self.save_as == "mixtral" and (self.residual or self.layers is not None):
            raise ValueError(
                "Mixtral has neither a shared expert nor dense layers between sparse ones: save_as='mixtral' takes "
                "plain upcycling of every layer; use save_as='source' (a leanlm_moe block) for this one"
            )

    @property
    def experts_per_token(self) -> int:
        return self.top_k if self.top_k is not None else (1 if self.residual else 2)

    @property
    def scoring(self) -> str:
        """softmax_renorm: the chosen experts' weights sum to 1, so identical copies (or halves) add up to the dense
        MLP. PR-MoE with zero-initialised experts needs no such sum (they add nothing either way), and takes Switch's
        gate, the router's probability itself: renormalised over one expert it would be 1 whatever the router
        said, and the router would learn nothing from the next-token loss."""
        return "softmax" if self.residual and self.residual_init == "zero" else "softmax_renorm"

    def moe_config(self, intermediate_size: int, num_layers: int) -> MoEConfig:
        """The MoEConfig of the upcycled model, whose dense FFNs are `intermediate_size` wide."""
        if self.layers is not None and max(self.layers) >= num_layers:
            raise ValueError(f"layers {self.layers} name layers past the model's {num_layers}")
        every = self.layers is None or len(self.layers) == num_layers
        return MoEConfig(
            num_experts=self.num_experts,
            top_k=self.experts_per_token,
            expert_intermediate_size=intermediate_size,
            scoring=self.scoring,
            shared_expert_intermediate_size=intermediate_size if self.residual else 0,
            shared_expert_gate=False,
            sparse_layers=None if every else self.layers,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )


def _float_weight(module: nn.Module, name: str) -> torch.Tensor:
    if type(module) not in (nn.Linear, Linear) or module.bias is not None:
        raise ValueError(
            f"{name} is a {type(module).__name__}: upcycling copies float, bias-free MLP linears, so put "
            "UpcycleConfig before any quantizer or pruner in the recipe"
        )
    return module.weight.detach()


def upcycled_block(
    mlp: LlamaMLP, config, cfg: UpcycleConfig, gen: torch.Generator, name: str = "mlp"
) -> SparseMoeBlock:
    """A SparseMoeBlock (for ModelConfig `config`, whose moe is cfg's) made from the dense `mlp`: E copies (PR-MoE:
    the shared expert and E copies, initialised per cfg.residual_init) and a router of small random weights."""
    if not isinstance(mlp, LlamaMLP):
        raise ValueError(f"{name} is a {type(mlp).__name__}, not a dense MLP: the model is upcycled already")
    dense = {p: _float_weight(getattr(mlp, p), f"{name}.{p}") for p in ("gate_proj", "up_proj", "down_proj")}
    weight = dense["down_proj"]
    std = cfg.router_std if cfg.router_std is not None else math.sqrt(0.1 / config.hidden_size)
    state = {"gate.weight": (torch.randn(cfg.num_experts, config.hidden_size, generator=gen) * std).to(weight)}
    expert_down = weight
    if cfg.residual:
        shared_down = weight * 0.5 if cfg.residual_init == "half" else weight.clone()
        expert_down = weight * 0.5 if cfg.residual_init == "half" else torch.zeros_like(weight)
        state["shared_expert.gate_proj.weight"] = dense["gate_proj"].clone()
        state["shared_expert.up_proj.weight"] = dense["up_proj"].clone()
        state["shared_expert.down_proj.weight"] = shared_down
    for e in range(cfg.num_experts):  # separate tensors: the copies train apart
        state[f"experts.{e}.gate_proj.weight"] = dense["gate_proj"].clone()
        state[f"experts.{e}.up_proj.weight"] = dense["up_proj"].clone()
        state[f"experts.{e}.down_proj.weight"] = expert_down.clone()
    with torch.device("meta"):  # no random init of E x 3 linears that are overwritten at once
        block = SparseMoeBlock(config)
    block.load_state_dict(state, assign=True)
    return block.requires_grad_(weight.requires_grad)


def upcycled_architecture(architecture: str, attention_bias: bool, moe: MoEConfig, save_as: str) -> str:
    """What the upcycled model saves as (UpcycleConfig.save_as)."""
    plain = not moe.shared_expert_intermediate_size and moe.sparse_layers is None
    mixtral_can = architecture == "llama" and not attention_bias and plain
    if save_as == "mixtral" and not mixtral_can:
        raise ValueError(
            f"a {architecture} model{' with q/k/v bias' if attention_bias else ''} cannot be saved as Mixtral "
            "(a bias-free llama, plain upcycling of every layer); use save_as='source'"
        )
    if save_as == "mixtral" or (save_as == "auto" and mixtral_can):
        return "mixtral"
    return architecture


@register_method(UpcycleConfig)
class Upcycling(Method):
    def begin(self, model: nn.Module) -> None:
        config, cfg = model.config, self.config
        if config.moe is not None:
            raise ValueError("the model is a mixture of experts already; upcycle a dense model")
        moe = cfg.moe_config(config.intermediate_size, config.num_hidden_layers)
        architecture = upcycled_architecture(config.architecture, config.attention_bias, moe, cfg.save_as)
        new = dataclasses.replace(config, architecture=architecture, moe=moe)
        gen = torch.Generator().manual_seed(cfg.seed)
        for i, layer in enumerate(model.model.layers):
            if moe.is_sparse(i):
                layer.mlp = upcycled_block(layer.mlp, new, cfg, gen, f"model.layers.{i}.mlp")
            layer.linear_groups = layer_groups(new, moe.is_sparse(i))
        model.config = new

    def apply_layer(self, layer, prefix, inputs):
        return []  # everything happened in begin
