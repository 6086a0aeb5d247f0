"""FP8 W8A8: e4m3 weights and per-token activations through torch's scaled FP8 matmul (CPU, and CUDA on Hopper),
else dequantize + F.linear."""

from __future__ import annotations

import functools

import torch

from leanlm.model.linear.base import RuntimeLinear, register_format
from leanlm.model.linear.checks import check_numel, matrix_shape
from leanlm.model.linear.shard import COLUMN, refuse_row_split
from leanlm.model.quantized.numerics import quantize_fp8


@functools.cache
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU _scaled_mm takes per-row scales (torch 2.13 does; 2.11 asserts per-tensor)."""
    x = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(x, x.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm runs FP8 with per-row scales on CPU (where this torch can) and on CUDA from compute
    capability 8.9 (Ada, Hopper)."""
    if device.type == "cpu":
        return _cpu_rowwise_scaled_mm()
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@register_format
class FP8Linear(RuntimeLinear):
    """FP8 W8A8: weights in e4m3 (or e5m2) with per-channel scales, activations scaled per token on the fly,
    multiplied by torch._scaled_mm (fp32 accumulation) where supported, else dequantized."""

    format = "fp8"
    tensor_names = ("weight", "weight_scale")

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, k = matrix_shape(self.format, "weight", weight)
        if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{self.format} tensor weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")
        check_numel(self.format, "weight_scale", weight_scale, n)
        super().__init__(k, n, bias)
        self.register_buffer("weight", weight.contiguous())  # [N, K] float8
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1, 1).contiguous())  # [N, 1]

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale

    def shard_unit(self, axis: int) -> int:
        if axis != COLUMN:
            raise refuse_row_split(self.format, "each token's activation scale spans all of its inputs")
        return 1

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        return {"weight": self.weight[cut], "weight_scale": self.weight_scale[cut]}

    def fallback(self, x: torch.Tensor) -> torch.Tensor:  # no native kernel: every row count
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_fp8(x2, self.weight.dtype, per_row=True)  # [T, K], [T, 1]
        if scaled_mm_supported(x.device) and self.weight.dtype is torch.float8_e4m3fn:
            y = torch._scaled_mm(
                xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.t(), bias=None, out_dtype=torch.float32
            )
        else:
            y = (xq.float() * xs) @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
