"""ZeroQuant's layer-by-layer knowledge distillation (LKD, Yao et al. 2022): after a quantizer, each decoder layer
is trained to reproduce the float layer's output on the calibration activations entering it, one layer at a time,
with no data beyond the calibration text.

For each quantized linear of the layer, the student is a FakeQuantLinear: its weight in float (starting from the
dequantized weight) with the quantizer's per-group scale and offset, all trainable, rounded onto the grid in the
forward with a straight-through estimator. After `steps` Adam steps on the relative MSE to the float layer's output, the
weights are rounded once more and the layer gets back its own runtime format, with new codes and parameters. A
layer that ends farther from the float one, over all calibration sequences, than the quantizer left it keeps the
quantizer's result: LKD never makes a layer worse on the text it sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import NEEDS_LAYER, LayerInputs, Method, MethodConfig, register_method
from leanlm.model.forward import decoder_layer
from leanlm.model.quantized.fake_quant import GRID_LR_SCALE, attach_fake_quant, detach_fake_quant


@dataclass(frozen=True)
class LKDConfig(MethodConfig):
    steps: int = 100  # Adam steps per layer
    lr: float = 1e-4  # of the weights; scales and offsets learn at lr * GRID_LR_SCALE (a tenth)
    batch_size: int = 4  # calibration sequences per step

    name = "lkd"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"LKD needs steps >= 1, batch_size >= 1 and lr > 0, got {self}")


def relative_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean() / target.pow(2).mean()


@register_method(LKDConfig)
class LKD(Method):
    needs = frozenset({NEEDS_LAYER})

    def __init__(self, config: LKDConfig) -> None:
        super().__init__(config)
        self.losses: dict[str, tuple[float, float]] = {}  # layer -> relative MSE before, after

    def begin(self, model: nn.Module) -> None:
        self.rotary, self.losses = model.rotary_emb, {}

    def apply_layer(self, layer, prefix, inputs):
        return []  # the loop calls fit_layer: LKD needs calibration data (NEEDS_LAYER)

    def fit_layer(self, layer: nn.Module, prefix: str, inputs: LayerInputs) -> list:
        cfg, hidden = self.config, inputs.hidden  # [S, T, d]
        rope = self.rotary(torch.arange(hidden.shape[1], device=hidden.device), hidden.dtype)
        with torch.no_grad():
            target = decoder_layer(inputs.teacher, hidden, rope)  # [S, T, d]
            before = float(relative_mse(decoder_layer(layer, hidden, rope), target))
        frozen = [p for p in layer.parameters() if p.requires_grad]  # the layer's float tensors stay as they are
        students = attach_fake_quant(layer)
        if not students:
            return []
        for p in frozen:
            p.requires_grad_(False)
        weights = [s.weight for s in students]
        grids = [p for s in students for p in (s.scale, s.offset) if p is not None]
        opt = torch.optim.Adam([{"params": weights}, {"params": grids, "lr": cfg.lr * GRID_LR_SCALE}], lr=cfg.lr)
        after = before
        try:
            with torch.enable_grad():
                for step in range(cfg.steps):
                    rows = [(step * cfg.batch_size + i) % hidden.shape[0] for i in range(cfg.batch_size)]
                    loss = relative_mse(decoder_layer(layer, hidden[rows], rope), target[rows])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
            with torch.no_grad():  # the stand-ins compute what their runtime layers will
                after = float(relative_mse(decoder_layer(layer, hidden, rope), target))
        finally:  # trained layers where they are closer to the float one; else (or after an error) the quantizer's
            detach_fake_quant(layer, trained=after < before)
            for p in frozen:
                p.requires_grad_(True)
        self.losses[prefix] = (before, min(before, after))
        return []

    def summary(self) -> dict:
        if not self.losses:
            return {}
        first = sum(b for b, _ in self.losses.values()) / len(self.losses)
        last = sum(a for _, a in self.losses.values()) / len(self.losses)
        improved = sum(a < b for b, a in self.losses.values()) / len(self.losses)
        return {"layer rel. MSE before": first, "layer rel. MSE after": last, "layers improved": improved}
