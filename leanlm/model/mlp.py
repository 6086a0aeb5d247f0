"""The gated feed-forward block (HF's LlamaMLP: SwiGLU; Gemma's GeGLU with tanh GELU): a dense layer's MLP, and
each expert of a sparse one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.kernels import cpu_rows
from leanlm.model.layers import Linear


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.hidden_act = hidden_act  # the gate's activation: "silu" or "gelu_pytorch_tanh"
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.hidden_act != "silu":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        # the native loop's arithmetic, which has no backward: not for rows autograd records (training)
        if cpu_rows.should_use_rows(gate) and up.is_contiguous() and not gate.requires_grad:
            return self.down_proj(cpu_rows.silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)
