"""W4A16 / W3A16 / W2A16: group-wise 2-4 bit weight-only linears (GGUF's Q4_0 / Q4_1 / Q4_K and GPTQ load into it);
few-row decode on the native int4 GEMV (bf16 on AVX512, float32 on AVX2), 9+ bf16 rows on the packed GEMM, else
dequantize + F.linear (natively where a kernel does it, once and kept where none does)."""

from __future__ import annotations

import math
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
from leanlm.model.linear.checks import check_group_size, check_indices, check_shape, matrix_shape
from leanlm.model.linear.shard import COLUMN, groups, refuse_row_split, scaled
from leanlm.model.packed_cache import PackedCache
from leanlm.model.quantized.numerics import unpack_int4


@register_format
class IntGroupWeightOnlyLinear(DynamicActQuant, RuntimeLinear):
    """W4A16 / W3A16 / W2A16: unsigned b-bit codes in groups along K, w = q * scale + min per group.

    Codes are stored two per byte whatever b is (3- and 2-bit codes use part of the nibble), the layout the
    CPU kernel reads. With GPTQ act-order, columns are stored in quantization order and `perm` [K] reorders
    the input to match (x[..., perm]), so groups stay contiguous for the kernel.
    """

    format = "int_group_weight_only"
    tensor_names = ("qweight", "scales", "mins")

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        bits: int,
        group_size: int,
        perm: torch.Tensor | None = None,
    ) -> None:
        n, half_k = matrix_shape(self.format, "qweight", qweight)
        super().__init__(half_k * 2, n, bias)
        if not isinstance(bits, int) or not 2 <= bits <= 4:
            raise ValueError(f"group-wise weight-only layers hold 2-4 bit codes, got bits={bits!r}")
        check_group_size(self.format, group_size, self.in_features)
        if scales.shape != (self.out_features, self.in_features // group_size):
            raise ValueError(
                f"scales {tuple(scales.shape)} do not match [N, K / group_size] for "
                f"K={self.in_features}, group_size={group_size}"
            )
        check_shape(self.format, "mins", mins, *scales.shape)
        if perm is not None:
            perm = check_indices(self.format, "perm", perm, self.in_features, permutation=True)
        self.bits, self.group_size = bits, group_size
        self.register_buffer("qweight", qweight.to(torch.uint8).contiguous())  # [N, K/2]
        self.register_buffer("scales", scales.float().contiguous())  # [N, G]
        self.register_buffer("mins", mins.float().contiguous())  # [N, G]
        self.register_buffer("perm", None if perm is None else perm.long().contiguous())  # [K]
        self.compact_scales = PackedCache()  # scales and mins as the AVX2 W4A8 kernels read them best (_compact)
        self._init_act_quant()

    @classmethod
    def from_tensors(cls, meta, tensors):
        layer = super().from_tensors(meta, {k: v for k, v in tensors.items() if k != "perm"})
        if "perm" in tensors:  # a permutation of range(K): the kernel gathers x[:, perm] unchecked
            layer.perm = check_indices(cls.format, "perm", tensors["perm"], layer.in_features, permutation=True)
        return layer

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "bits": self.bits, "group_size": self.group_size}

    def weight_bytes(self) -> int:
        return super().weight_bytes() + (0 if self.perm is None else self.perm.numel() * 8)

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] in the input's original column order."""
        q = unpack_int4(self.qweight).float()  # [N, K], stored column order
        n, k = q.shape
        w = q.view(n, k // self.group_size, self.group_size) * self.scales[..., None] + self.mins[..., None]
        w = w.reshape(n, k)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)  # stored column j is input column perm[j]
        return w

    def shard_unit(self, axis: int) -> int:
        if axis == COLUMN:
            return 1
        if self.perm is not None:
            raise refuse_row_split(self.format, "its act-order permutation (perm) mixes input columns of every shard")
        return math.lcm(self.group_size, 2)  # whole groups, and two codes share a byte

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        if axis == COLUMN:
            tensors = {"qweight": self.qweight[cut], "scales": self.scales[cut], "mins": self.mins[cut]}
            return tensors if self.perm is None else {**tensors, "perm": self.perm}
        g = self.group_size
        return {"qweight": self.qweight[:, scaled(cut, 2)], "scales": groups(self.scales, cut, g),
                "mins": groups(self.mins, cut, g)}  # fmt: skip

    def _pack(self, qweight, scales, mins, bias) -> cpu_gemm.PackedQuant:
        return cpu_gemm.pack_quant(unpack_int4(qweight), scales, mins, self.group_size, 4, bias)

    def packed_weight(self) -> cpu_gemm.PackedQuant | None:
        if not (self.qweight.is_cpu and cpu_gemm.quant_is_available()):  # 2-4 bit codes: nibbles alike
            return None
        return self.packed.get((self.qweight, self.scales, self.mins, self.bias), self._pack)

    def _permuted(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in the stored column order (act-order)."""
        return x if self.perm is None else x.index_select(-1, self.perm)

    stored_order = _permuted

    def _a8_tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.qweight, self.scales, self.mins, self.bias

    def _pack_a8(self, qweight, scales, mins, bias) -> cpu_a8.PackedA8:
        return cpu_a8.pack_int4(unpack_int4(qweight), scales, mins, self.group_size, bias)

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return packs_rows(x, self.qweight, self.bias)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:  # widened a panel at a time into a bf16 GEMM
        return cpu_gemm.gemm_quant(self._permuted(x), self.packed_weight())

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        if not self._bias_fits(x):
            return False
        if x.dtype is torch.float32:
            return cpu_qgemv_avx2.should_use_int4(x, self.qweight, self.group_size)
        return cpu_qgemv.should_use_int4(x, self.qweight, self.group_size)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        xp = self._permuted(x)
        kernels = cpu_qgemv_avx2 if x.dtype is torch.float32 else cpu_qgemv
        return kernels.linear_int4(xp, self.qweight, self.scales, self.mins, self.group_size, self.bias)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        if dequantizes_natively(x, self.qweight, self.bias):  # one bf16 weight, one GEMM
            w = cpu_qgemv.dequantize_int4(self.qweight, self.scales, self.mins, self.group_size)
            return F.linear(self._permuted(x), w, self.bias)
        if dequantizes_avx2(x, self.qweight, self.bias):  # one float32 weight, one sgemm
            w = cpu_qgemv_avx2.dequantize_int4(self.qweight, self.scales, self.mins, self.group_size)
            return F.linear(self._permuted(x), w, self.bias)
        return self.dense_forward(x)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        if self.act_int8(torch.bfloat16):
            return self.act_quant_native(packed)
        few = cpu_qgemv.int4_native_call(self.qweight, self.scales, self.mins, self.bias, self.group_size)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed, self.perm)

    def native_linear_f32(self) -> NativeLinear | None:
        if not self.act_int8(torch.float32):
            few = cpu_qgemv_avx2.int4_native_call(self.qweight, self.scales, self.mins, self.bias, self.group_size)
        elif isinstance(compact := self._compact(), cpu_kquant_avx2.SuperScales):
            few = cpu_kquant_avx2.int4k_native_call(self.qweight, compact, self.bias)
        else:
            scales, mins = compact or (self.scales, self.mins)
            few = cpu_qgemv_avx2.int4_native_call(self.qweight, scales, mins, self.bias, self.group_size, True)
        return describe(self.out_features, self.in_features, few, None, False, self.perm)

    def _compact(self) -> tuple[torch.Tensor, torch.Tensor] | cpu_kquant_avx2.SuperScales | None:
        """The scales and mins in the fewest bytes the AVX2 W4A8 kernels read exactly: half copies (GGUF's Q4_0 /
        Q4_1 keep theirs so), Q4_K's super-block factors (4-bit codes and 6-bit scales in groups of 32), or None
        (the float32 ones)."""
        if not self.scales.is_cpu:
            return None
        return self.compact_scales.get((self.scales, self.mins), self._make_compact)

    def _make_compact(self, scales, mins):
        halves = cpu_qgemv_avx2.half_copies(scales, mins, self.group_size)
        if halves is not None or self.group_size != 32:
            return halves
        return cpu_kquant_avx2.super_scales(scales, mins)

    def act_quant_avx2(self, xs: torch.Tensor) -> torch.Tensor | None:
        if not self._bias_fits(xs):
            return None
        compact = self._compact()
        if isinstance(compact, cpu_kquant_avx2.SuperScales):
            if cpu_kquant_avx2.should_use_int4k(xs, self.qweight, compact, self.bias):
                return cpu_kquant_avx2.linear_int4k_a8(xs, self.qweight, compact, self.bias)
            compact = None
        if cpu_qgemv_avx2.should_use_int4_a8(xs, self.qweight, self.group_size):
            scales, mins = compact or (self.scales, self.mins)
            return cpu_qgemv_avx2.linear_int4_a8(xs, self.qweight, scales, mins, self.group_size, self.bias)
        return None

    def a8_stored_weight(self) -> torch.Tensor:
        if cpu_qgemv_avx2.dequantizes(self.qweight):
            return cpu_qgemv_avx2.dequantize_int4(self.qweight, self.scales, self.mins, self.group_size)
        return super().a8_stored_weight()

    def _bias_fits(self, x: torch.Tensor) -> bool:
        return self.bias is None or self.bias.dtype is x.dtype
