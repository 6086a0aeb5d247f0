"""2:4 sparse linear layers whose kept weights are quantized: int8 (symmetric, per channel or per group) and
2-4 bit codes (group-wise with a zero code). They store only the kept weights' codes next to Sparse24Linear's
mask, so batch-1 decode reads 62.5% (int8) or 75% (int4) of the dense quantized codes' bytes.

A recipe that prunes to 2:4 and then quantizes (`[SparseGPTConfig(pattern="2:4"), GPTQConfig(bits=4)]`) ends
with these (`from_quantized` converts the dense quantized layer exactly). Groups run along the dense input
columns, as in the dense formats, so the conversion keeps every scale.
"""

from __future__ import annotations

from typing import Any

import torch

from leanlm.kernels import cpu_gemm, cpu_sparse
from leanlm.kernels.native_linear import NativeLinear, describe
from leanlm.model.linear.base import RuntimeLinear, packs_rows, register_format
from leanlm.model.linear.checks import check_shape, matrix_shape
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.shard import COLUMN, groups, scaled
from leanlm.model.linear.sparse24 import check_mask, compress_24, mask_bits
from leanlm.model.packed_cache import PackedCache
from leanlm.model.quantized.numerics import pack_int4, unpack_int4

CHUNK = cpu_sparse.CHUNK  # dense columns per 16 bytes of int4 codes (32 kept codes)


def pack_chunks(codes: torch.Tensor) -> torch.Tensor:
    """Kept 4-bit codes uint8 [N, K / 2] (column order) -> [N, K / 4]: per 64 dense columns 16 bytes, byte i
    holding the chunk's kept code i in its low nibble and code 16 + i in its high nibble (the kernel's order)."""
    n, half = codes.shape
    pairs = codes.to(torch.uint8).view(n, half // 32, 2, 16)  # [N, chunks, low / high, 16]
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, half // 2).contiguous()


def unpack_chunks(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_chunks: [N, K / 4] -> kept codes uint8 [N, K / 2] in column order."""
    n, quarter = packed.shape
    chunks = packed.view(n, quarter // 16, 16)
    return torch.stack((chunks & 0x0F, chunks >> 4), dim=2).reshape(n, quarter * 2)


def widen(kept: torch.Tensor, mask: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Dense [N, K]: kept [N, K / 2] at the mask's columns, `fill` [N, K] elsewhere."""
    return fill.clone().masked_scatter_(mask_bits(mask), kept)


def _per_column(groups: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K]."""
    return groups.repeat_interleave(k // groups.shape[1], dim=1)


def _kept_codes(dense_codes: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept codes [N, K / 2], mask) of a quantized layer whose dequantized `weight` [N, K] is 2:4: the
    nonzeros of every group and, where a group has fewer, its first zero columns (compress_24's choice)."""
    _, mask = compress_24(weight)
    n, k = weight.shape
    return dense_codes[mask_bits(mask)].view(n, k // 2), mask


def _check_chunks(fmt: str, k: int, group_size: int) -> None:
    if not cpu_sparse.quant_group_ok(group_size, k):
        raise ValueError(
            f"{fmt} needs in_features and group_size multiples of {CHUNK} (the group dividing in_features), got "
            f"in_features={k}, group_size={group_size}: keep this layer in its dense quantized format"
        )


class _QuantizedSparse24(RuntimeLinear):
    """What the two share: 9+ rows run cpu_gemm's quantized GEMM over the widened codes, anything no kernel
    takes runs the dense quantized layer of those codes (`dense_layer`)."""

    codes: torch.Tensor  # and each defines dense_layer()

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return packs_rows(x, self.codes, self.bias) and self.packed_weight() is not None

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.gemm_quant(x, self.packed.value)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_layer()(x)


@register_format
class Sparse24Int8Linear(_QuantizedSparse24):
    """W 2:4 sparse with int8 kept weights: `codes` int8 [N, K / 2] (the kept codes in column order), `mask`
    [N, K / 8] as Sparse24Linear's, `scales` float32 [N] (group_size None) or [N, K / group_size]; w = q * scale.

    Up to 8 bf16 rows run on cpu_sparse's kernel, 9+ on cpu_gemm's int8 GEMM over the widened codes; anything
    else (CPUs without VBMI2, float32 inputs) on the dense int8 layer of the widened codes, made on first use."""

    format = "sparse24_int8"
    tensor_names = ("codes", "mask", "scales")

    def __init__(self, codes, mask, scales, bias=None, *, group_size: int | None = None) -> None:
        n, half_k = matrix_shape(self.format, "codes", codes)
        super().__init__(2 * half_k, n, bias)
        k = self.in_features
        if codes.dtype != torch.int8:
            raise ValueError(f"{self.format} tensor codes must be int8, not {codes.dtype}")
        _check_chunks(self.format, k, k if group_size is None else group_size)
        check_mask(self.format, mask, n, k)
        if group_size is None:
            check_shape(self.format, "scales", scales.reshape(-1), n)
        else:
            check_shape(self.format, "scales", scales, n, k // group_size)
        self.group_size = group_size
        self.register_buffer("codes", codes.contiguous())  # [N, K/2]
        self.register_buffer("mask", mask.contiguous())  # [N, K/8]
        self.register_buffer("scales", scales.float().reshape(n, -1).contiguous())  # [N, G]
        self.dense = PackedCache()  # dense_layer()

    @classmethod
    def from_quantized(cls, layer: Int8WeightOnlyLinear) -> Sparse24Int8Linear:
        """The same layer with its codes 2:4 compressed (exact); ValueError if its weight is not 2:4 or its
        shape does not fit the kernel."""
        codes, mask = _kept_codes(layer.qweight, layer.dequantized_weight())
        return cls(codes, mask, layer.scales, layer.bias, group_size=layer.group_size)

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        return meta if self.group_size is None else {**meta, "group_size": self.group_size}

    @property
    def _kernel_group(self) -> int:
        return self.group_size or self.in_features

    def dense_codes(self) -> torch.Tensor:
        """int8 [N, K]: the kept codes at their columns, 0 elsewhere."""
        fill = torch.zeros(self.out_features, self.in_features, dtype=torch.int8, device=self.codes.device)
        return widen(self.codes, self.mask, fill)

    def dequantized_weight(self) -> torch.Tensor:
        return self.dense_codes().float() * _per_column(self.scales, self.in_features)

    def shard_unit(self, axis: int) -> int:
        if axis == COLUMN:
            return 1
        return self.group_size or CHUNK  # whole groups (each holds whole chunks), or whole chunks per channel

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        if axis == COLUMN:
            return {"codes": self.codes[cut], "mask": self.mask[cut], "scales": self.scales[cut]}
        scales = self.scales if self.group_size is None else groups(self.scales, cut, self.group_size)
        return {"codes": self.codes[:, scaled(cut, 2)], "mask": self.mask[:, scaled(cut, 8)], "scales": scales}

    def _dense(self, codes, mask, scales, bias) -> Int8WeightOnlyLinear:
        gs = self.group_size
        return Int8WeightOnlyLinear(self.dense_codes(), scales if gs else scales.view(-1), bias, group_size=gs)

    def dense_layer(self) -> Int8WeightOnlyLinear:
        """The same layer with dense codes (zeros at the pruned columns), kept while the tensors stay the same."""
        return self.dense.get((self.codes, self.mask, self.scales, self.bias), self._dense)

    def _pack(self, codes, mask, scales, bias) -> cpu_gemm.PackedQuant:
        return cpu_gemm.pack_quant(self.dense_codes(), scales, None, self._kernel_group, 8, bias)

    def packed_weight(self) -> cpu_gemm.PackedQuant | None:
        if not (self.codes.is_cpu and cpu_gemm.quant_is_available()):
            return None
        return self.packed.get((self.codes, self.mask, self.scales, self.bias), self._pack)

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        bias_ok = self.bias is None or self.bias.dtype is x.dtype
        return bias_ok and cpu_sparse.should_use_quant(x, self.codes, 8, self._kernel_group) and not x.requires_grad

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_sparse.linear_sparse24_quant(
            x, self.codes, self.mask, self.scales, None, self.bias, 8, self._kernel_group
        )

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        if not cpu_sparse.quant_is_available():  # the loop runs the dense codes on the int8 kernel
            return self.dense_layer().native_linear(packed)
        g = self._kernel_group
        few = cpu_sparse.quant_native_call(self.codes, self.mask, self.scales, None, self.bias, 8, g)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed)


@register_format
class Sparse24Int4Linear(_QuantizedSparse24):
    """W 2:4 sparse with 2-4 bit kept codes: `codes` uint8 [N, K / 4] (pack_chunks' order), `mask` [N, K / 8]
    as Sparse24Linear's, `scales` float32 and `zeros` uint8 [N, K / group_size]; w = q * scale + min with
    min = -(zero * scale), so the grid holds 0 exactly (IntGroupWeightOnlyLinear's numbers, bit for bit).

    Up to 8 bf16 rows run on cpu_sparse's kernel, 9+ on cpu_gemm's int4 GEMM over the widened codes (pruned
    columns hold the zero code); anything else (CPUs without VBMI2, float32 inputs) on the dense layer of those
    codes, made on first use."""

    format = "sparse24_int4"
    tensor_names = ("codes", "mask", "scales", "zeros")

    def __init__(self, codes, mask, scales, zeros, bias=None, *, bits: int, group_size: int) -> None:
        n, quarter_k = matrix_shape(self.format, "codes", codes)
        super().__init__(4 * quarter_k, n, bias)
        k, fmt = self.in_features, self.format
        if codes.dtype != torch.uint8 or zeros.dtype != torch.uint8:
            raise ValueError(f"{fmt} tensors codes and zeros must be uint8, not {codes.dtype} and {zeros.dtype}")
        if not isinstance(bits, int) or not 2 <= bits <= 4:
            raise ValueError(f"{fmt} holds 2-4 bit codes, got bits={bits!r}")
        _check_chunks(fmt, k, group_size)
        check_mask(fmt, mask, n, k)
        check_shape(fmt, "scales", scales, n, k // group_size)
        check_shape(fmt, "zeros", zeros, n, k // group_size)
        if zeros.numel() and int(zeros.max()) > 15:
            raise ValueError(f"{fmt} zero codes must be 0-15, found {int(zeros.max())}")
        self.bits, self.group_size = bits, group_size
        self.register_buffer("codes", codes.contiguous())  # [N, K/4]
        self.register_buffer("mask", mask.contiguous())  # [N, K/8]
        self.register_buffer("scales", scales.float().contiguous())  # [N, G]
        self.register_buffer("zeros", zeros.contiguous())  # [N, G]
        self.dense = PackedCache()  # dense_layer()

    @classmethod
    def from_quantized(cls, layer: IntGroupWeightOnlyLinear) -> Sparse24Int4Linear:
        """The same layer with its codes 2:4 compressed (exact); ValueError if its weight is not 2:4, its columns
        are permuted (act-order without static groups), its grid has no exact zero or its shape does not fit."""
        if layer.perm is not None:
            raise ValueError(
                "an act-order layer stores its columns permuted, which breaks the 2:4 groups: quantize with "
                "static groups (GPTQConfig(static_groups=True)) to pack it as 2:4"
            )
        scales, mins = layer.scales, layer.mins
        zeros = torch.where(scales != 0, -mins / scales, torch.zeros_like(scales)).round()
        if not torch.equal(-(zeros * scales), mins) or zeros.min() < 0 or zeros.max() > 15:
            raise ValueError("the layer's mins are not -(zero * scale) for zero codes 0-15: its grid has no exact 0")
        dense = unpack_int4(layer.qweight)  # [N, K]
        codes, mask = _kept_codes(dense, layer.dequantized_weight())
        return cls(
            pack_chunks(codes), mask, scales, zeros.to(torch.uint8), layer.bias, bits=layer.bits,
            group_size=layer.group_size,
        )  # fmt: skip

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "bits": self.bits, "group_size": self.group_size}

    def mins(self) -> torch.Tensor:
        """float32 [N, G]: -(zero * scale), as IntGroupWeightOnlyLinear stores them."""
        return -(self.zeros.float() * self.scales)

    def dense_codes(self) -> torch.Tensor:
        """uint8 [N, K]: the kept codes at their columns, the group's zero code elsewhere."""
        fill = _per_column(self.zeros, self.in_features)
        return widen(unpack_chunks(self.codes), self.mask, fill)

    def dequantized_weight(self) -> torch.Tensor:
        k = self.in_features
        w = self.dense_codes().float() * _per_column(self.scales, k) + _per_column(self.mins(), k)
        return w.masked_fill_(~mask_bits(self.mask), 0.0)  # pruned: zero * scale + min, exactly 0 already

    def shard_unit(self, axis: int) -> int:
        return 1 if axis == COLUMN else self.group_size  # whole groups, and whole chunks (a group holds them)

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        names = ("codes", "mask", "scales", "zeros")
        if axis == COLUMN:
            return {name: getattr(self, name)[cut] for name in names}
        g = self.group_size
        return {"codes": self.codes[:, scaled(cut, 4)], "mask": self.mask[:, scaled(cut, 8)],
                "scales": groups(self.scales, cut, g), "zeros": groups(self.zeros, cut, g)}  # fmt: skip

    def _dense(self, codes, mask, scales, zeros, bias) -> IntGroupWeightOnlyLinear:
        packed = pack_int4(self.dense_codes())
        return IntGroupWeightOnlyLinear(packed, scales, self.mins(), bias, bits=self.bits, group_size=self.group_size)

    def dense_layer(self) -> IntGroupWeightOnlyLinear:
        """The same layer with dense codes (the zero code at the pruned columns), kept while the tensors stay."""
        return self.dense.get((self.codes, self.mask, self.scales, self.zeros, self.bias), self._dense)

    def _pack(self, codes, mask, scales, zeros, bias) -> cpu_gemm.PackedQuant:
        return cpu_gemm.pack_quant(self.dense_codes(), scales, self.mins(), self.group_size, 4, bias)

    def packed_weight(self) -> cpu_gemm.PackedQuant | None:
        if not (self.codes.is_cpu and cpu_gemm.quant_is_available()):
            return None
        return self.packed.get((self.codes, self.mask, self.scales, self.zeros, self.bias), self._pack)

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        bias_ok = self.bias is None or self.bias.dtype is x.dtype
        return bias_ok and cpu_sparse.should_use_quant(x, self.codes, 4, self.group_size) and not x.requires_grad

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_sparse.linear_sparse24_quant(
            x, self.codes, self.mask, self.scales, self.zeros, self.bias, 4, self.group_size
        )

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        if not cpu_sparse.quant_is_available():  # the loop runs the dense codes on the int4 kernel
            return self.dense_layer().native_linear(packed)
        g = self.group_size
        few = cpu_sparse.quant_native_call(self.codes, self.mask, self.scales, self.zeros, self.bias, 4, g)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed)


def to_sparse24_quantized(layer: RuntimeLinear) -> RuntimeLinear:
    """A dense int8 or 2-4 bit layer whose weight is 2:4 as its 2:4 format; ValueError when it cannot be."""
    if isinstance(layer, Int8WeightOnlyLinear):
        return Sparse24Int8Linear.from_quantized(layer)
    if isinstance(layer, IntGroupWeightOnlyLinear):
        return Sparse24Int4Linear.from_quantized(layer)
    raise ValueError(f"no 2:4 format for {type(layer).__name__}; int8 and 2-4 bit weight-only layers have one")
