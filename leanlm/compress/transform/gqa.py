"""MHA -> GQA / MQA conversion (Ainslie et al. 2023): fewer K/V heads, each made from the group of heads whose
query heads it will serve, so the KV cache shrinks by old / new heads. The paper mean-pools each group's K and V
projections and then uptrains briefly (`leanlm train --recipe finetune` on the converted checkpoint); keeping the
group's first head and random initialisation are its baselines.

A transform, not a quantizer: it rewrites every layer's k_proj / v_proj and the model's head count before the
layer loop, and the result saves as a normal checkpoint with the new `num_key_value_heads`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import Method, MethodConfig, register_method
from leanlm.model.layers import Linear

INITS = ("mean", "first", "random")


@dataclass(frozen=True)
class GQAConfig(MethodConfig):
    num_key_value_heads: int = 1  # 1: multi-query attention
    init: str = "mean"  # mean-pool each group's heads (the paper's), keep its first head, or random
    seed: int = 0  # of the random initialisation

    name = "gqa"

    def __post_init__(self) -> None:
        if self.num_key_value_heads < 1:
            raise ValueError(f"num_key_value_heads must be >= 1, got {self.num_key_value_heads}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {', '.join(INITS)}, got {self.init!r}")


def group_heads(
    weight: torch.Tensor, bias: torch.Tensor | None, new_heads: int, head_dim: int, init: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A K or V projection weight [old * D, hidden] (bias [old * D]) as [new * D, hidden]: new head g from old heads
    g * r .. g * r + r - 1 (r = old / new), the ones whose query heads it takes over."""
    rows, hidden = weight.shape
    old = rows // head_dim
    w = weight.detach().reshape(new_heads, old // new_heads, head_dim, hidden)  # [new, r, D, hidden]
    b = None if bias is None else bias.detach().reshape(new_heads, old // new_heads, head_dim)
    if init == "mean":
        return w.mean(1).reshape(-1, hidden), None if b is None else b.mean(1).reshape(-1)
    if init == "first":
        return w[:, 0].reshape(-1, hidden).clone(), None if b is None else b[:, 0].reshape(-1).clone()
    # random: the old weights' scale, nothing of their values
    std = float(weight.detach().float().std())
    noise = torch.randn(new_heads * head_dim, hidden, generator=gen) * std
    zero_bias = None if bias is None else torch.zeros_like(bias[: new_heads * head_dim])
    return noise.to(weight.dtype).to(weight.device), zero_bias


def _regrouped(linear: nn.Module, name: str, new_heads: int, head_dim: int, init: str, gen) -> Linear:
    if type(linear) not in (nn.Linear, Linear):
        raise ValueError(
            f"{name} is a {type(linear).__name__}: GQA conversion regroups float projections, so put GQAConfig "
            "before any quantizer or pruner in the recipe"
        )
    weight, bias = group_heads(linear.weight, linear.bias, new_heads, head_dim, init, gen)
    out = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


@register_method(GQAConfig)
class GQAConversion(Method):
    def begin(self, model: nn.Module) -> None:
        config, new = model.config, self.config.num_key_value_heads
        old, heads = config.num_key_value_heads, config.num_attention_heads
        if new == old:
            return
        if new > old or old % new:
            raise ValueError(
                f"the model has {old} K/V heads ({heads} query heads): they merge into a number that divides "
                f"{old}, e.g. {', '.join(str(d) for d in range(1, old) if old % d == 0)}; got {new}"
            )
        gen = torch.Generator().manual_seed(self.config.seed)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for proj in ("k_proj", "v_proj"):
                name = f"model.layers.{i}.self_attn.{proj}"
                setattr(attn, proj, _regrouped(getattr(attn, proj), name, new, attn.head_dim, self.config.init, gen))
            attn.num_kv_heads = new
        model.config = dataclasses.replace(config, num_key_value_heads=new)

    def apply_layer(self, layer, prefix, inputs):
        return []  # everything happened in begin
