"""Activation-sparse linear layers (TEAL, Liu et al. 2024; CATS, Lee et al. 2024): inputs of magnitude at or
below a calibrated per-layer threshold are set to zero, and at decode the kernel skips the weight rows those
inputs would multiply, so it reads fewer bytes. The weight is kept dense (nothing is pruned from it), stored
transposed [K, N] so that each input column's weights are contiguous. The method that calibrates the
thresholds lives in leanlm.compress.act_sparsity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_act_sparse, cpu_decode
from leanlm.model.quantized.linear import QuantLinear, check_numel, matrix_shape, register_format


@register_format
class ActSparseLinear(QuantLinear):
    """y = s(x) W^T + b, s(x) = x where |x| > threshold else 0; weight_t = W^T [K, N] in the compute dtype."""

    format = "act_sparse"
    tensor_names = ("weight_t", "threshold")
    compute_dtype_buffers = ("weight_t", "bias")

    def __init__(self, weight_t: torch.Tensor, threshold: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        k, n = matrix_shape(self.format, "weight_t", weight_t)
        check_numel(self.format, "threshold", threshold, 1)
        value = float(threshold.reshape(-1)[0])
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{self.format} threshold must be a finite value >= 0, got {value}")
        super().__init__(k, n, bias)
        self.register_buffer("weight_t", weight_t.detach().clone().contiguous())  # [K, N]
        self.register_buffer("threshold", torch.tensor([value], dtype=torch.float32))  # [1]
        self.threshold_value = value  # read by every forward; the buffer is what checkpoints save

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Linear, threshold: float, dtype: torch.dtype | None = None
    ) -> ActSparseLinear:
        dtype = linear.weight.dtype if dtype is None else dtype
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(linear.weight.detach().t().to(dtype), torch.tensor([threshold]), bias)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_t.t().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        bias = self.bias
        if cpu_act_sparse.should_use(x, self.weight_t, bias) and not (x.requires_grad and torch.is_grad_enabled()):
            return cpu_act_sparse.linear_act_sparse(x, self.weight_t, self.threshold_value, bias)
        weight = self.weight_t.t().to(x.dtype)
        return F.linear(
            cpu_act_sparse.sparsify(x, self.threshold_value), weight, None if bias is None else bias.to(x.dtype)
        )

    def native_linear(self, packed: bool = False) -> cpu_decode.NativeLinear | None:
        """The native decode loop runs this layer to 8 rows; a loop of more rows (packed) would run a dense
        GEMM, which does not sparsify, so it is not offered one."""
        if packed or not cpu_act_sparse.is_available():
            return None
        return cpu_decode.NativeLinear(cpu_decode.KIND_ACT_SPARSE, self.weight_t, scales=self.threshold, bias=self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, threshold={self.threshold_value:.4g}"
