"""LLM.int8() (Dettmers et al. 2022): int8 weights and activations, with outlier input columns in a 16-bit product."""

from __future__ import annotations

import math
from typing import Any

import torch

from leanlm.model.linear.base import RuntimeLinear, register_format
from leanlm.model.linear.checks import check_indices, check_numel, check_shape, matrix_shape
from leanlm.model.linear.shard import COLUMN, refuse_row_split
from leanlm.model.linear.w8a8 import int8_matmul
from leanlm.model.quantized.numerics import quantize_per_token_int8


@register_format
class LLMInt8Linear(RuntimeLinear):
    """LLM.int8(): vector-wise int8 (per-row weight scales, per-token activation scales) plus a 16-bit product
    over outlier feature columns. `outlier_idx` columns (found on calibration data) keep their exact weights
    in `outlier_weight`; input columns exceeding `threshold` at run time that are not among them take the
    16-bit path with their int8 weights dequantized, as bitsandbytes does.
    """

    format = "llm_int8"
    tensor_names = ("qweight", "scales", "outlier_idx", "outlier_weight")
    compute_dtype_buffers = ("bias", "outlier_weight")

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        outlier_idx: torch.Tensor,
        outlier_weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        threshold: float = 6.0,
    ) -> None:
        n, k = matrix_shape(self.format, "qweight", qweight)
        super().__init__(k, n, bias)
        check_numel(self.format, "scales", scales, n)
        outlier_idx = check_indices(self.format, "outlier_idx", outlier_idx, k, permutation=False)
        check_shape(self.format, "outlier_weight", outlier_weight, n, outlier_idx.numel())
        # A threshold of another type, or not a positive finite number, would leave every column outlier-free or
        # an outlier: refused like any other inconsistent metadata (a fuzzed `[]` gave non-finite logits).
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
            raise ValueError(f"{self.format} threshold must be a positive finite number, got {threshold!r}")
        self.threshold = float(threshold)
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())  # [N, K], outlier columns 0
        self.register_buffer("scales", scales.reshape(-1).float().contiguous())  # [N]
        self.register_buffer("outlier_idx", outlier_idx)  # [O]
        self.register_buffer("outlier_weight", outlier_weight.contiguous())  # [N, O], 16/32-bit, exact
        mask = torch.zeros(self.in_features, dtype=torch.bool, device=qweight.device)
        mask[self.outlier_idx] = True
        self.register_buffer("is_static_outlier", mask, persistent=False)  # [K]

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "threshold": self.threshold}

    def dequantized_weight(self) -> torch.Tensor:
        w = self.qweight.float() * self.scales[:, None]
        w[:, self.outlier_idx] = self.outlier_weight.float()
        return w

    def shard_unit(self, axis: int) -> int:
        if axis != COLUMN:
            raise refuse_row_split(self.format, "each token's activation scale spans all of its inputs")
        return 1

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight[cut], "scales": self.scales[cut], "outlier_idx": self.outlier_idx,
                "outlier_weight": self.outlier_weight[cut]}  # fmt: skip

    def fallback(self, x: torch.Tensor) -> torch.Tensor:  # no native kernel: every row count
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        dynamic = (x2.abs() > self.threshold).any(dim=0) & ~self.is_static_outlier  # [K] new outlier columns
        inliers = x2.masked_fill(self.is_static_outlier | dynamic, 0)
        xq, xs = quantize_per_token_int8(inliers)
        y = (
            int8_matmul(xq, xs, self.qweight, self.scales).to(x.dtype)
            + x2[:, self.outlier_idx] @ self.outlier_weight.to(x.dtype).t()
        )
        if dynamic.any():
            cols = dynamic.nonzero().squeeze(1)
            w_cols = (self.qweight[:, cols].float() * self.scales[:, None]).to(x.dtype)  # [N, O']
            y = y + x2[:, cols] @ w_cols.t()
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)
