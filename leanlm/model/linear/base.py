"""RuntimeLinear: what every runtime weight format is (its tensors, metadata, reference path, kernel calls, shard
and stack), and LINEAR_FORMATS, which maps the `format` saved in a checkpoint to the class that loads it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.kernels import cpu_gemm, cpu_qgemv, cpu_qgemv_avx2
from leanlm.kernels.native_linear import NativeCall, NativeLinear
from leanlm.model.dense_copy import DenseCopy
from leanlm.model.linear.checks import check_shape
from leanlm.model.linear.dispatch import KernelDispatch
from leanlm.model.linear.shard import COLUMN, check_axis, part, row_bias
from leanlm.model.linear.stack import StackedLinear
from leanlm.model.packed_cache import PackedCache

LINEAR_FORMATS: dict[str, type[RuntimeLinear]] = {}


def register_format(cls: type[RuntimeLinear]) -> type[RuntimeLinear]:
    LINEAR_FORMATS[cls.format] = cls
    return cls


class RuntimeLinear(KernelDispatch, nn.Module, ABC):
    """Base: a linear layer y = x W^T + b whose W is stored in a runtime format (quantized codes, sparse values and
    masks, or a transposed dense weight) in buffers named by `tensor_names`."""

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
        self.dense = DenseCopy()  # the dequantized weight, where no kernel runs this format (dense_forward)

    def set_compute_dtype(self, dtype: torch.dtype) -> RuntimeLinear:
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
    def from_tensors(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> RuntimeLinear:
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

    def native_linear_f32(self) -> NativeLinear | None:
        """This layer as the float32 decode loop (AVX2 level, up to 16 rows, 64 with int8 activations) runs it, or
        None."""
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
        """y where neither kernel takes the rows (KernelDispatch): dense_forward unless a format has better."""
        return self.dense_forward(x)

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reference path on a kept dequantized copy of W (dense_copy.py), made once while the memory budget
        allows; per call (reference_forward) beyond it, on other devices, and for formats with trainable tensors."""
        if not x.is_cpu or any(p.requires_grad for p in self.parameters(recurse=False)):
            return self.reference_forward(x)
        sources = tuple(getattr(self, n, None) for n in (*self.tensor_names, "perm"))
        w = self.dense.get(sources, x.dtype, self.dequantized_weight, self.format)
        if w is None:
            return self.reference_forward(x)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def shard_unit(self, axis: int) -> int:
        """Features along `axis` (shard.COLUMN or ROW) that must stay in one shard (a quant group, a 2:4 group,
        codes sharing a byte); raises shard.refuse_row_split where the format cannot split that way at all."""
        return 1

    @abstractmethod
    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        """This layer's saved tensors (bias aside) for the features `cut` along `axis`, whole units of shard_unit."""

    def shard(self, axis: int, rank: int, world: int, sizes: tuple[int, ...] | None = None) -> RuntimeLinear:
        """Rank `rank` of `world` shards along `axis` (equal, or of `sizes` features each): COLUMN keeps a slice of
        the outputs (the shards' outputs concatenated are this layer's), ROW a slice of the inputs (their outputs
        summed are; rank 0 keeps the bias). ValueError when the format's units would be cut or it cannot split so."""
        check_axis(axis)
        size = self.out_features if axis == COLUMN else self.in_features
        cut = part(size, axis, rank, world, self.shard_unit(axis), self.format, sizes)
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
    def stack(cls, layers: list[RuntimeLinear]) -> StackedLinear:
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


def dequantizes_avx2(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """float32 CPU activations (and bias) over CPU codes: dequantize to float32 with the AVX2 kernel, then one sgemm."""
    return (
        x.dtype is torch.float32
        and x.is_cpu
        and (bias is None or bias.dtype is torch.float32)
        and cpu_qgemv_avx2.dequantizes(qweight)
    )


def dequantizes_natively(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None) -> bool:
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
