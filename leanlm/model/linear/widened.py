"""The base of the sparse layers stored in the model's float dtype (2:4, unstructured): their kernels widen the
weight in registers for a few bf16 rows, and every other path runs a dense copy of it (the packed GEMM for 9+ rows,
the bf16 GEMV where the sparse kernel is missing, F.linear otherwise), with the same numbers."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_gemm, cpu_gemv
from leanlm.kernels.native_linear import NativeCall, NativeLinear, describe
from leanlm.model.linear.base import RuntimeLinear, packs_rows
from leanlm.model.packed_cache import PackedCache


class WidenedSparseLinear(RuntimeLinear):
    """y = x W^T + b with W stored as `values` (the kept weights, in the compute dtype), `mask` and whatever else
    `sparse_tensors` names. A subclass says how to widen (values, mask) to W [N, K] and how its kernel runs."""

    compute_dtype_buffers = ("bias", "values")
    widen: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (values, mask) -> W [N, K] in values' dtype

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__(in_features, out_features, bias)
        self.dense = PackedCache()  # the widened weight, for the paths that run on a dense weight

    @abstractmethod
    def sparse_tensors(self) -> tuple[torch.Tensor, ...]:
        """(values, mask, ...): what the kernel reads, in its argument order."""

    @abstractmethod
    def kernel_should_use(self, x: torch.Tensor) -> bool:
        """The sparse kernel takes these rows (its policy: dtype, row count, CPU features)."""

    @abstractmethod
    def kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y from the sparse kernel."""

    @abstractmethod
    def native_sparse(self) -> NativeCall | None:
        """The decode loop's few-row call of the sparse kernel, or None where that kernel is not loaded."""

    def tensor_core_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The weight as the GPU's sparse tensor cores take it, for these CUDA rows; None where they should not
        run (the default: only 2:4 has such hardware)."""
        return None

    def dequantized_weight(self) -> torch.Tensor:
        return type(self).widen(self.values, self.mask).float()

    def dense_weight(self) -> torch.Tensor:
        """The widened weight [N, K] in the values' dtype, kept while values and mask stay the same."""
        return self.dense.get((self.values, self.mask), type(self).widen)

    def _pack(self, values, mask, bias) -> cpu_gemm.PackedBF16:
        return cpu_gemm.pack(type(self).widen(values, mask), bias)

    def packed_weight(self) -> cpu_gemm.PackedBF16 | None:
        """The dense weight in cpu_gemm's panels (bf16 values on the CPU), for 9+ rows."""
        if not (self.values.dtype is torch.bfloat16 and self.values.is_cpu and cpu_gemm.is_available()):
            return None
        return self.packed.get((self.values, self.mask, self.bias), self._pack)

    def _dtypes_match(self, x: torch.Tensor) -> bool:
        """Values and bias in x's dtype: the kernels' and the dense copy's case (else the reference path)."""
        return self.values.dtype is x.dtype and (self.bias is None or self.bias.dtype is x.dtype)

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return self._dtypes_match(x) and packs_rows(x, self.values, self.bias) and self.packed_weight() is not None

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.gemm(x, self.packed.value)

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        no_grad = not (x.requires_grad and torch.is_grad_enabled())  # the kernels have no backward
        return self._dtypes_match(x) and no_grad and self.kernel_should_use(x)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.bias)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        if not self._dtypes_match(x):
            return self.reference_forward(x)
        bias = self.bias
        no_grad = not (x.requires_grad and torch.is_grad_enabled())
        sparse_weight = self.tensor_core_weight(x) if no_grad and x.is_cuda else None
        if sparse_weight is not None:
            return F.linear(x, sparse_weight, bias)
        dense = self.dense_weight()
        if no_grad and cpu_gemv.should_use(x, dense):
            return cpu_gemv.linear_bf16(x, dense, bias)  # no sparse kernel: the same numbers from the dense copy
        return F.linear(x, dense, bias)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        # Without the sparse kernel the loop runs the dense copy on the bf16 GEMV (same numbers, dense bytes).
        few = self.native_sparse() or cpu_gemv.native_call(self.dense_weight(), self.bias)
        return describe(self.out_features, self.in_features, few, self.many_rows_call(packed), packed)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtype={self.values.dtype}"
