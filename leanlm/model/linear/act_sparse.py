"""Activation-sparse linear layers (TEAL, Liu et al. 2024; CATS, Lee et al. 2024): inputs of magnitude at or
below a calibrated per-layer threshold are set to zero, and at decode the kernel skips the weight rows those
inputs would multiply, so it reads fewer bytes. The weight is kept dense (nothing is pruned from it), stored
transposed [K, N] so that each input column's weights are contiguous. The method that calibrates the
thresholds lives in leanlm.compress.activation.act_sparsity.
"""

from __future__ import annotations

import math

import torch

from leanlm.kernels import cpu_act_sparse
from leanlm.kernels.native_linear import NativeLinear, describe
from leanlm.model.linear.base import RuntimeLinear, register_format
from leanlm.model.linear.checks import check_numel, matrix_shape
from leanlm.model.linear.shard import COLUMN


@register_format
class ActSparseLinear(RuntimeLinear):
    """y = s(x) W^T + b, s(x)_k = x_k where |x_k| * column_scale_k > threshold, else 0; weight_t = W^T [K, N] in
    the compute dtype (a skipped input is a skipped row). column_scale [K] is 1 for TEAL's magnitude score, the
    weight's column norms for the weight-aware score (|x_k| ||W[:, k]||: the size of what input k adds to the
    output)."""

    format = "act_sparse"
    tensor_names = ("weight_t", "threshold", "column_scale")
    compute_dtype_buffers = ("weight_t", "bias")

    def __init__(
        self,
        weight_t: torch.Tensor,
        threshold: torch.Tensor,
        column_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        k, n = matrix_shape(self.format, "weight_t", weight_t)
        check_numel(self.format, "threshold", threshold, 1)
        check_numel(self.format, "column_scale", column_scale, k)
        value = float(threshold.reshape(-1)[0])
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{self.format} threshold must be a finite value >= 0, got {value}")
        scale = column_scale.detach().to(weight_t.device, torch.float32).reshape(k).contiguous()
        if not bool(torch.isfinite(scale).all() and (scale >= 0).all()):
            raise ValueError(f"{self.format} column_scale must hold finite values >= 0")
        super().__init__(k, n, bias)
        self.register_buffer("weight_t", weight_t.detach().clone().contiguous())  # [K, N]
        self.register_buffer("threshold", torch.tensor([value], dtype=torch.float32, device=weight_t.device))  # [1]
        self.register_buffer("column_scale", scale.clone())  # [K] float32
        self.threshold_value = value  # read by every forward; the buffer is what checkpoints save

    @classmethod
    def from_linear(
        cls,
        linear: torch.nn.Linear,
        threshold: float,
        column_scale: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> ActSparseLinear:
        dtype = linear.weight.dtype if dtype is None else dtype
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        scale = torch.ones(linear.in_features) if column_scale is None else column_scale
        return cls(linear.weight.detach().t().to(dtype), torch.tensor([threshold]), scale, bias)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_t.t().float()

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        # the score of input k needs only x_k and column_scale[k]: either split keeps each shard's inputs' scores
        if axis == COLUMN:
            return {"weight_t": self.weight_t[:, cut], "threshold": self.threshold, "column_scale": self.column_scale}
        return {"weight_t": self.weight_t[cut], "threshold": self.threshold, "column_scale": self.column_scale[cut]}

    def few_rows_fit(self, x: torch.Tensor) -> bool:  # never many rows: a dense GEMM would not sparsify its input
        kernel_ok = cpu_act_sparse.should_use(x, self.weight_t, self.column_scale, self.bias)
        return kernel_ok and not (x.requires_grad and torch.is_grad_enabled())

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return cpu_act_sparse.linear_act_sparse(x, self.weight_t, self.threshold_value, self.column_scale, self.bias)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return cpu_act_sparse.reference(x, self.weight_t.to(x.dtype), self.threshold_value, self.column_scale, bias)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        """The native decode loop runs this layer to 8 rows; a loop of more rows (packed) would run a dense
        GEMM, which does not sparsify, so it is not offered one."""
        if packed or not cpu_act_sparse.is_available():
            return None
        few = cpu_act_sparse.native_call(self.weight_t, self.threshold, self.column_scale, self.bias)
        return describe(self.out_features, self.in_features, few, None, packed)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, threshold={self.threshold_value:.4g}"
