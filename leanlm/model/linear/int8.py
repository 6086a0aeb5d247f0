"""W8A16: int8 weight-only linears (per channel, or per group: GGUF's Q8_0 / Q5_0 / Q6_K load into it); few-row
decode on the native int8 GEMV, 9+ bf16 rows on the packed GEMM, else dequantize + F.linear."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_a8, cpu_gemm, cpu_kquant_avx2, cpu_qgemv, cpu_qgemv_avx2
from leanlm.kernels.native_linear import NativeLinear, describe
from leanlm.model.linear.act_quant import DynamicActQuant
from leanlm.model.linear.base import (
    RuntimeLinear,
    dequantizes_avx2,
    dequantizes_natively,
    packs_rows,
    register_format,
)
from leanlm.model.linear.checks import check_numel, check_shape, matrix_shape
from leanlm.model.linear.shard import COLUMN, groups
from leanlm.model.packed_cache import PackedCache


def scaled_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """float32 [N, K] = int8 codes [N, K] * scales: [N] per channel (group_size None) or [N, K / group_size]."""
    if group_size is None:
        return qweight.float() * scales[:, None]
    n, k = qweight.shape
    return (qweight.float().view(n, k // group_size, group_size) * scales[..., None]).reshape(n, k)


@register_format
class Int8WeightOnlyLinear(DynamicActQuant, RuntimeLinear):
    """W8A16: symmetric int8 weights with one scale per output channel, or per group of `group_size` input
    columns (GGUF's Q8_0 and Q5_0 blocks: group 32; Q6_K: group 16); activations stay 16/32-bit."""

    format = "int8_weight_only"
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
        if group_size is None:
            check_numel(self.format, "scales", scales, n)
            scales = scales.reshape(-1)
        else:
            if not cpu_qgemv.int8_group_ok(group_size, k):
                raise ValueError(
                    f"{self.format}: group_size must be 16 or a multiple of 32, dividing K={k} (itself a multiple "
                    f"of 32), not {group_size!r} (or None: one scale per channel)"
                )
            check_shape(self.format, "scales", scales, n, k // group_size)
        self.group_size = group_size
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())  # [N, K]
        self.register_buffer("scales", scales.float().contiguous())  # [N], or [N, K / group_size]
        self.six_bit = PackedCache()  # Q6_K-like codes in their own 6.6 bits, for the AVX2 int6 GEMV (made on use)
        self._init_act_quant()

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        return meta if self.group_size is None else {**meta, "group_size": self.group_size}

    def dequantized_weight(self) -> torch.Tensor:
        return scaled_int8(self.qweight, self.scales, self.group_size)

    def shard_unit(self, axis: int) -> int:
        return 1 if axis == COLUMN or self.group_size is None else self.group_size

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        if axis == COLUMN:
            return {"qweight": self.qweight[cut], "scales": self.scales[cut]}
        scales = self.scales if self.group_size is None else groups(self.scales, cut, self.group_size)
        return {"qweight": self.qweight[:, cut], "scales": scales}

    def _pack(self, qweight, scales, bias) -> cpu_gemm.PackedQuant:
        group = qweight.shape[1] if self.group_size is None else self.group_size
        return cpu_gemm.pack_quant(qweight, scales.reshape(qweight.shape[0], -1), None, group, 8, bias)

    def packed_weight(self) -> cpu_gemm.PackedQuant | None:
        if not (self.qweight.is_cpu and cpu_gemm.quant_is_available()):
            return None
        return self.packed.get((self.qweight, self.scales, self.bias), self._pack)

    def _a8_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.qweight, self.scales, self.bias

    def _pack_a8(self, qweight, scales, bias) -> cpu_a8.PackedA8:
        return cpu_a8.pack_int8(qweight, scales, self.group_size, bias)

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return packs_rows(x, self.qweight, self.bias)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:  # widened a panel at a time into a bf16 GEMM
        return cpu_gemm.gemm_quant(x, self.packed_weight())

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        if self.bias is not None and self.bias.dtype is not x.dtype:
            return False
        if x.dtype is torch.float32:
            return cpu_qgemv_avx2.should_use_int8(x, self.qweight, self.group_size)
        return cpu_qgemv.should_use_int8(x, self.qweight, self.group_size)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_qgemv_avx2 if x.dtype is torch.float32 else cpu_qgemv
        return kernels.linear_int8(x, self.qweight, self.scales, self.bias, self.group_size)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        if dequantizes_natively(x, self.qweight, self.bias):  # one bf16 weight, one GEMM
            return F.linear(x, cpu_qgemv.dequantize_int8(self.qweight, self.scales, self.group_size), self.bias)
        if dequantizes_avx2(x, self.qweight, self.bias):  # one float32 weight, one sgemm
            return F.linear(x, cpu_qgemv_avx2.dequantize_int8(self.qweight, self.scales, self.group_size), self.bias)
        return self.dense_forward(x)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        if self.act_int8(torch.bfloat16):
            return self.act_quant_native(packed)
        few = cpu_qgemv.int8_native_call(self.qweight, self.scales, self.bias, self.group_size)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed)

    def supports_act_quant(self, dtype: torch.dtype | None = None) -> bool:
        """Also Q6_K's groups of 16 in a float32 model, where its codes and scales fit the AVX2 int6 GEMV."""
        if super().supports_act_quant(dtype):
            return True
        return dtype is torch.float32 and self.group_size == 16 and self.six_bit_weight() is not None

    def six_bit_weight(self) -> cpu_kquant_avx2.SixBit | None:
        """The codes and scales in Q6_K's widths (groups of 16 whose scales factor per super-block), else None."""
        if self.group_size != 16 or not self.qweight.is_cpu:
            return None
        return self.six_bit.get((self.qweight, self.scales), cpu_kquant_avx2.six_bit_copy)

    def act_quant_avx2(self, xs: torch.Tensor) -> torch.Tensor | None:
        bias_ok = self.bias is None or self.bias.dtype is xs.dtype
        if self.group_size == 16:
            six = self.six_bit_weight()
            fits = cpu_kquant_avx2.should_use_int6(xs, six, self.bias)
            return cpu_kquant_avx2.linear_int6_a8(xs, six, self.bias) if fits else None
        if bias_ok and cpu_qgemv_avx2.should_use_int8_a8(xs, self.qweight, self.group_size):
            return cpu_qgemv_avx2.linear_int8_a8(xs, self.qweight, self.scales, self.bias, self.group_size)
        return None

    def a8_stored_weight(self) -> torch.Tensor:
        if cpu_qgemv_avx2.dequantizes(self.qweight):
            return cpu_qgemv_avx2.dequantize_int8(self.qweight, self.scales, self.group_size)
        return super().a8_stored_weight()

    def native_linear_f32(self) -> NativeLinear | None:
        int8_act = self.act_int8(torch.float32)
        if int8_act and self.group_size == 16:
            six = self.six_bit_weight()
            few = None if six is None else cpu_kquant_avx2.int6_native_call(six, self.bias)
        elif int8_act:
            few = cpu_qgemv_avx2.int8_native_call(self.qweight, self.scales, self.bias, self.group_size, act_int8=True)
        else:
            few = cpu_qgemv_avx2.int8_native_call(self.qweight, self.scales, self.bias, self.group_size)
        return describe(self.out_features, self.in_features, few, None, False)
