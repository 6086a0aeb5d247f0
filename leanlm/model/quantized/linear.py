"""Runtime quantized linear layers, one class per saved format, each with a fast path and a reference path.

Weight-only int8 / int2-4 (group-wise) run few-row decode on leanlm's native GEMV kernels and 9+ bf16 rows on
its packed GEMM (the weight widened a panel at a time), everything else as dequantize + F.linear. The other
formats have modules of their own: W8A8 int8 (w8a8.py), FP8 (fp8.py), LLM.int8() (llm_int8.py).
`QUANT_LINEAR_FORMATS` maps the `format` saved in a checkpoint to the class that loads it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.kernels import cpu_gemm, cpu_qgemv
from leanlm.kernels.native_linear import NativeCall, NativeLinear, describe
from leanlm.model.linear.checks import check_group_size, check_indices, check_numel, check_shape, matrix_shape
from leanlm.model.linear.dispatch import KernelDispatch
from leanlm.model.linear.shard import COLUMN, check_axis, groups, part, refuse_row_split, row_bias, scaled
from leanlm.model.linear.stack import StackedLinear
from leanlm.model.packed_cache import PackedCache
from leanlm.model.quantized.numerics import unpack_int4

QUANT_LINEAR_FORMATS: dict[str, type[QuantLinear]] = {}


def register_format(cls: type[QuantLinear]) -> type[QuantLinear]:
    QUANT_LINEAR_FORMATS[cls.format] = cls
    return cls


class QuantLinear(KernelDispatch, nn.Module, ABC):
    """Base: a linear layer y = x W^T + b whose W is stored quantized in buffers named by `tensor_names`."""

    format: ClassVar[str]
    tensor_names: ClassVar[tuple[str, ...]]
    # 16/32-bit float buffers that run in the model's dtype (scales stay float32, codes stay integers)
    compute_dtype_buffers: ClassVar[tuple[str, ...]] = ("bias",)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        check_shape(self.format, "bias", bias, out_features)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.packed = PackedCache()  # the weight in cpu_gemm's panel order, for 9+ bf16 rows (packs_rows)

    def set_compute_dtype(self, dtype: torch.dtype) -> QuantLinear:
        """Cast the float buffers that take part in the model dtype's arithmetic (see compute_dtype_buffers)."""
        for name in self.compute_dtype_buffers:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(dtype))
        return self

    def metadata(self) -> dict[str, Any]:
        """What `from_tensors` needs besides the tensors: saved in quantization_config.json."""
        return {"format": self.format, "in_features": self.in_features, "out_features": self.out_features}

    @classmethod
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> QuantLinear:
        """Rebuild from saved metadata and tensors (names from `tensor_names`, plus optional 'bias')."""
        kwargs = {k: v for k, v in meta.items() if k not in ("format", "in_features", "out_features")}
        tensor_keys = sorted(set(kwargs) & {*cls.tensor_names, "bias", "perm"})
        if tensor_keys:  # a tensor argument given as a JSON value would reach the layer's tensor checks
            raise ValueError(f"{cls.format} layer metadata names {tensor_keys}, which are tensors, not settings")
        missing = [n for n in cls.tensor_names if n not in tensors]
        if missing:
            raise ValueError(f"{cls.format} layer is missing tensors {missing}")
        layer = cls(*(tensors[n] for n in cls.tensor_names), bias=tensors.get("bias"), **kwargs)
        declared = (meta.get("in_features"), meta.get("out_features"))
        if declared != (layer.in_features, layer.out_features):
            raise ValueError(
                f"{cls.format} layer declares in/out features {declared} but its tensors hold "
                f"{(layer.in_features, layer.out_features)}"
            )
        return layer

    @abstractmethod
    def dequantized_weight(self) -> torch.Tensor:
        """The float32 [N, K] weight this layer stands for (the reference path's W)."""

    def weight_bytes(self) -> int:
        """Bytes of the stored weight representation (codes + scales), bias excluded."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.tensor_names)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        """This layer as the native decode loop runs it (its kernels' calls), or None (that loop then is not used);
        with `packed`, with the packed GEMM its own products use from 9 rows on (see packed_weight)."""
        return None

    def many_rows_call(self, packed: bool) -> NativeCall | None:
        """The loop's many-row call: the packed GEMM on packed_weight(), when `packed`."""
        return cpu_gemm.native_call(self.packed_weight(), self.out_features, self.in_features) if packed else None

    def packed_weight(self) -> cpu_gemm.PackedQuant | None:
        """The weight in cpu_gemm's panel order (packed on first use, remade when the tensors change), or None
        where this format or device has no packed GEMM."""
        return None

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        """y where neither kernel takes the rows (KernelDispatch): the reference path unless a format has better."""
        return self.reference_forward(x)

    def shard_unit(self, axis: int) -> int:
        """Features along `axis` (shard.COLUMN or ROW) that must stay in one shard (a quant group, a 2:4 group,
        codes sharing a byte); raises shard.refuse_row_split where the format cannot split that way at all."""
        return 1

    @abstractmethod
    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        """This layer's saved tensors (bias aside) for the features `cut` along `axis`, whole units of shard_unit."""

    def shard(self, axis: int, rank: int, world: int) -> QuantLinear:
        """Rank `rank` of `world` equal shards along `axis`: COLUMN keeps a slice of the outputs (the shards' outputs
        concatenated are this layer's), ROW a slice of the inputs (their outputs summed are; rank 0 keeps the bias).
        ValueError when the format's units would be cut or it cannot split that way."""
        check_axis(axis)
        size = self.out_features if axis == COLUMN else self.in_features
        cut = part(size, axis, rank, world, self.shard_unit(axis), self.format)
        tensors = self.shard_tensors(axis, cut)
        bias = row_bias(self.bias, rank) if axis != COLUMN or self.bias is None else self.bias[cut]
        if bias is not None:
            tensors["bias"] = bias
        features = {"out_features": cut.stop - cut.start} if axis == COLUMN else {"in_features": cut.stop - cut.start}
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        return type(self).from_tensors({**self.metadata(), **features}, tensors)

    def stack_tensors(self) -> dict[str, torch.Tensor]:
        """What stack() stacks: the saved tensors by their from_tensors names, bias (and perm) where present."""
        names = (*self.tensor_names, "bias", "perm")
        return {n: t for n in names if (t := getattr(self, n, None)) is not None}

    @classmethod
    def stack(cls, layers: list[QuantLinear]) -> StackedLinear:
        """E experts of this format (one shape, one set of settings) stacked [E, ...] for a grouped GEMM."""
        if not all(isinstance(layer, cls) for layer in layers):
            raise ValueError(f"{cls.__name__}.stack takes {cls.__name__} layers only")
        return StackedLinear.of(list(layers))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def packs_rows(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """9+ contiguous bf16 CPU rows [M, K] (bias bf16 or none) over a CPU weight: the packed GEMM's case."""
    return (
        x.dim() == 2
        and x.shape[0] >= cpu_gemm.MIN_ROWS
        and x.dtype is torch.bfloat16
        and x.is_cpu
        and x.is_contiguous()
        and qweight.is_cpu
        and (bias is None or bias.dtype is torch.bfloat16)
        and not (x.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
        and cpu_gemm.quant_is_available()
    )


def _dequantizes_natively(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 CPU activations (and bias) over a CPU weight: dequantize to bf16 natively rather than in fp32 torch
    ops (about 10x faster for int4), same values rounded once."""
    return (
        x.dtype is torch.bfloat16
        and x.is_cpu
        and qweight.is_cpu
        and qweight.is_contiguous()
        and (bias is None or bias.dtype is torch.bfloat16)
        and cpu_qgemv.is_available()
    )


def scaled_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """float32 [N, K] = int8 codes [N, K] * scales: [N] per channel (group_size None) or [N, K / group_size]."""
    if group_size is None:
        return qweight.float() * scales[:, None]
    n, k = qweight.shape
    return (qweight.float().view(n, k // group_size, group_size) * scales[..., None]).reshape(n, k)


@register_format
class Int8WeightOnlyLinear(QuantLinear):
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

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return packs_rows(x, self.qweight, self.bias)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:  # widened a panel at a time into a bf16 GEMM
        return cpu_gemm.gemm_quant(x, self.packed_weight())

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        bias_ok = self.bias is None or self.bias.dtype is x.dtype
        return cpu_qgemv.should_use_int8(x, self.qweight, self.group_size) and bias_ok

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_qgemv.linear_int8(x, self.qweight, self.scales, self.bias, self.group_size)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        if _dequantizes_natively(x, self.qweight, self.bias):  # one bf16 weight, one GEMM
            return F.linear(x, cpu_qgemv.dequantize_int8(self.qweight, self.scales, self.group_size), self.bias)
        return self.reference_forward(x)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        few = cpu_qgemv.int8_native_call(self.qweight, self.scales, self.bias, self.group_size)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed)


@register_format
class IntGroupWeightOnlyLinear(QuantLinear):
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

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return packs_rows(x, self.qweight, self.bias)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:  # widened a panel at a time into a bf16 GEMM
        return cpu_gemm.gemm_quant(self._permuted(x), self.packed_weight())

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        bias_ok = self.bias is None or self.bias.dtype is x.dtype
        return cpu_qgemv.should_use_int4(x, self.qweight, self.group_size) and bias_ok

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        xp = self._permuted(x)
        return cpu_qgemv.linear_int4(xp, self.qweight, self.scales, self.mins, self.group_size, self.bias)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        if _dequantizes_natively(x, self.qweight, self.bias):  # one bf16 weight, one GEMM
            w = cpu_qgemv.dequantize_int4(self.qweight, self.scales, self.mins, self.group_size)
            return F.linear(self._permuted(x), w, self.bias)
        return self.reference_forward(x)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        few = cpu_qgemv.int4_native_call(self.qweight, self.scales, self.mins, self.bias, self.group_size)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed, self.perm)
