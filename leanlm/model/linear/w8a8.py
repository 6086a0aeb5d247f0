"""W8A8 int8 (SmoothQuant, ZeroQuant): int8 weights, activations quantized per token on the fly; and the exact
int8 x int8 -> int32 product that LLM.int8() shares."""

from __future__ import annotations

from typing import Any

import torch

from leanlm.kernels import cpu_w8a8
from leanlm.kernels.native_linear import NativeLinear, describe
from leanlm.model.linear.base import RuntimeLinear, register_format
from leanlm.model.linear.checks import check_group_size, check_numel, matrix_shape
from leanlm.model.linear.int8 import scaled_int8
from leanlm.model.linear.shard import COLUMN, refuse_row_split
from leanlm.model.quantized.numerics import quantize_per_token_int8


def int8_matmul(xq: torch.Tensor, xs: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, N] = (xq [T, K] int8 * xs [T, 1]) @ (qweight [N, K] int8 * scales [N])^T: torch's exact
    int8 x int8 -> int32 product on CPU, the same arithmetic in float elsewhere."""
    if xq.device.type == "cpu":
        # K = 1: qweight.t() has strides (1, 1), which torch 2.13's CPU _int_mm misreads (garbage sums)
        w_t = qweight.t() if qweight.shape[1] > 1 else qweight.reshape(1, -1)
        return torch._int_mm(xq, w_t).float() * xs * scales
    return (xq.float() * xs) @ (qweight.float() * scales[:, None]).t()


@register_format
class Int8DynamicActLinear(RuntimeLinear):
    """W8A8 (SmoothQuant, ZeroQuant): int8 weights, activations quantized per token on the fly.

    Per-channel weights run an int8 x int8 -> int32 product, then y = acc * s_x[t] * s_w[n]: on bf16 CPU rows,
    leanlm's VNNI kernel (cpu_w8a8, on a packed copy of the codes, any number of rows), else torch's
    `_int_mm`; the two agree bit for bit. Group-wise weights (ZeroQuant; group_size set) compute the same
    products in float from the integer codes.
    """

    format = "int8_dynamic_activation"
    tensor_names = ("qweight", "scales")

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        group_size: int | None = None,
    ) -> None:
        n, k = matrix_shape(self.format, "qweight", qweight)
        super().__init__(k, n, bias)
        if group_size is not None:
            check_group_size(self.format, group_size, k)
        check_numel(self.format, "scales", scales, n if group_size is None else n * (k // group_size))
        self.group_size = group_size
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())  # [N, K]
        scales = scales.float().reshape(n) if group_size is None else scales.float().reshape(n, -1)
        self.register_buffer("scales", scales.contiguous())  # [N] per channel or [N, G] per group

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "group_size": self.group_size}

    def dequantized_weight(self) -> torch.Tensor:
        return scaled_int8(self.qweight, self.scales, self.group_size)

    def shard_unit(self, axis: int) -> int:
        if axis != COLUMN:
            raise refuse_row_split(self.format, "each token's activation scale spans all of its inputs")
        return 1

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight[cut], "scales": self.scales[cut]}

    def _pack(self, qweight, scales, bias) -> cpu_w8a8.PackedW8A8:
        return cpu_w8a8.pack(qweight, scales, bias)

    def packed_weight(self) -> cpu_w8a8.PackedW8A8 | None:
        """The codes in the VNNI kernel's layout (packed on first use, remade when the tensors change), or None
        where that kernel does not apply (group-wise scales, a non-CPU weight, a CPU without AVX512-VNNI)."""
        if self.group_size is not None or not self.qweight.is_cpu or not cpu_w8a8.is_available():
            return None
        return self.packed.get((self.qweight, self.scales, self.bias), self._pack)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        call = cpu_w8a8.native_call(self.packed_weight(), self.out_features, self.in_features)
        return describe(self.out_features, self.in_features, call, call, packed)  # one kernel at every row count

    def _kernel_fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype is torch.bfloat16
            and x.is_cpu
            and not (x.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
            and cpu_w8a8.rows_fit(x.reshape(-1, x.shape[-1]), self.packed_weight())
        )

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_w8a8.gemm(x.reshape(-1, x.shape[-1]), self.packed_weight())  # [T, N]
        return y.reshape(*x.shape[:-1], self.out_features)

    # One VNNI kernel, on one packing, at every row count.
    many_rows_fit = few_rows_fit = _kernel_fits
    many_rows = few_rows = _kernel

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_per_token_int8(x2)  # [T, K] int8, [T, 1]
        if self.group_size is None:
            y = int8_matmul(xq, xs, self.qweight, self.scales)
        else:
            y = (xq.float() * xs) @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)
