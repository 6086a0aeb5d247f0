"""LoRA training (Hu et al. 2021) on a frozen base, including a quantized one (QLoRA, Dettmers et al. 2023): each
target linear becomes base(x) + scale * (x A^T) B^T with only A and B trained (float32). A quantized base layer runs
its own kernels forward, and its input gradient comes from its dequantized weight in backward (no float copy is kept).
The result is written in PEFT's format (leanlm.formats.peft), which the engine and PEFT both load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.model.forward import causal_lm_loss
from leanlm.model.lora import LORA_TARGETS, lora_target_shapes


@dataclass(frozen=True)
class LoRATrainConfig:
    """What a LoRA run trains: rank-r pairs on the `targets` linears of every layer, scaled alpha / r."""

    r: int  # the rank of every pair
    alpha: float | None = None  # PEFT's lora_alpha (None: 2 r)
    targets: tuple[str, ...] = LORA_TARGETS  # the linear kinds adapted (HF names)
    use_rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    seed: int = 0  # seeds A's initialization (B starts at zero: the adapter starts as the base model)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"--lora takes the adapter rank, an integer >= 1 (e.g. 16), got {self.r!r}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(2 * self.r))
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"--lora-alpha must be a number > 0, got {self.alpha!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"--lora-targets names {unknown or 'nothing'}; choose among {', '.join(LORA_TARGETS)} (comma-separated)"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


class _FrozenBase(torch.autograd.Function):
    """y = layer(x) on the layer's own kernels (no graph through its codes); backward: dy W, W dequantized then."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        with torch.no_grad():  # flat rows [M, K]: the many-row kernels take training's [B, T, K] batches too
            return layer(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.layer.dequantized_weight()  # [N, K] float32, made for this backward only
        return grad @ weight.to(grad.dtype), None


class LoRALinear(nn.Module):
    """A frozen base linear (any runtime format) plus a trainable low-rank pair: base(x) + scaling (x A^T) B^T."""

    def __init__(self, base: nn.Module, r: int, scaling: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scaling = scaling
        device = next(iter(base.buffers()), next(iter(base.parameters()), None)).device
        # PEFT's initialization: A Kaiming-uniform (a = sqrt(5), as nn.Linear), B zero
        bound = 1 / math.sqrt(self.in_features)
        a = (torch.rand(r, self.in_features, generator=generator) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a.to(device))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=device))  # [out, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        is_dense = isinstance(self.base, nn.Linear)
        if is_dense or not (torch.is_grad_enabled() and x.requires_grad):
            y = self.base(x)
        else:
            y = _FrozenBase.apply(x, self.base)
        delta = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return y + self.scaling * delta.to(y.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The merged float32 weight (what a runtime consumer of this layer sees)."""
        base = self.base.weight.detach().float() if isinstance(self.base, nn.Linear) else self.base.dequantized_weight()
        return base + self.scaling * (self.lora_B.detach().float() @ self.lora_A.detach().float())


def attach_lora(model: nn.Module, config: LoRATrainConfig) -> dict[str, LoRALinear]:
    """Wrap every target linear of `model` (seeded, in module order) and freeze everything else; module name -> its
    wrapper. Deterministic, so a resumed run attaches the same modules before loading its state."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(config.seed)
    wrapped = {}
    for name in lora_target_shapes(model.config):
        if name.split(".")[-1] not in config.targets:
            continue
        base = model.get_submodule(name)
        if isinstance(base, LoRALinear):
            raise ValueError(f"{name} already has a LoRA pair")
        wrapped[name] = LoRALinear(base, config.r, config.scaling, generator)
        model.set_submodule(name, wrapped[name])
    if not wrapped:
        raise ValueError(f"the model has no {', '.join(config.targets)} linears an adapter can train")
    model.drop_native_plan()  # its layers changed
    return wrapped


def lora_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A [r, in], B [out, r]) of every attached pair, detached float32 on the host."""
    return {
        name: (m.lora_A.detach().float().cpu(), m.lora_B.detach().float().cpu())
        for name, m in model.named_modules()
        if isinstance(m, LoRALinear)
    }


class LoRAObjective:
    """The trainer's objective for a LoRA run: the next-token loss, with only the adapters' pairs trained."""

    def __init__(self, config: LoRATrainConfig) -> None:
        self.config = config

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)]

    def backward(self, model: nn.Module, input_ids: torch.Tensor, rows: list[int], scale: float) -> float:
        loss = causal_lm_loss(model, input_ids)
        (loss * scale).backward()
        return float(loss.detach())

    def identity(self) -> dict:
        c = self.config
        return {"lora": {"r": c.r, "alpha": c.alpha, "targets": list(c.targets), "use_rslora": c.use_rslora,
                         "seed": c.seed}}  # fmt: skip
