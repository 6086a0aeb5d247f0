"""Unstructured sparse linear layers (any pattern of zeros, as magnitude / Wanda / SparseGPT pruning leave at a
fraction), stored in compressed-tensors' "sparse-bitmask" layout: the nonzeros row-major, a bit per weight and each
row's start, so batch-1 decode reads 2 bytes per nonzero plus 1/8 byte per weight (36% of dense bf16 at 70%
zeros). The pruning methods that produce such weights live in leanlm.compress.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leanlm.kernels import cpu_bitmask, cpu_decode, cpu_gemm, cpu_gemv
from leanlm.model.packed_cache import PackedCache
from leanlm.model.quantized.linear import QuantLinear, check_shape, matrix_shape, packs_rows, register_format
from leanlm.model.sparse.semi_structured import mask_bits

# A pruned layer packs into (and a compressed-tensors checkpoint loads as) this format from this fraction of zeros
# on. Measured at batch 1 (2 threads, 60 copies of each weight cycled so they come from DRAM, AMD EPYC Zen 4) on
# SmolLM2's 576x576, 192x576, 1536x576 and 576x1536, gemv_bitmask.c against the dense bf16 GEMV: 0.7-1.0x at 40%
# zeros, 0.8-1.6x at 50% (depending on the shape and the run), 1.2-1.5x at 60% and 1.4-2.4x at 70%. From 60% on it
# wins on every shape in every run; below, the dense copy (or 2:4, whose kernel reads the same bytes at 50%) is
# as fast or faster.
MIN_SPARSITY = 0.6


def is_sparse_enough(num_zeros: int, n: int, k: int) -> bool:
    """At least MIN_SPARSITY of an [N, K] weight is zero, counted as a pruner does it: floor(MIN_SPARSITY * K)
    per row (so a 60% prune of K = 576, 345 zeros a row, counts)."""
    return num_zeros >= int(MIN_SPARSITY * k) * n


def _check_columns(fmt: str, k: int) -> None:
    if k % 8:
        raise ValueError(
            f"{fmt} needs in_features divisible by 8 (one mask byte per 8 input columns), got {k}: keep this layer "
            f"dense or pad its input columns with zeros to {k + 8 - k % 8}"
        )


def compress_bitmask(
    weight: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [nnz], mask uint8 [N, K / 8], row_offsets int64 [N]) of a weight [N, K]: its nonzeros row-major (in
    `dtype`; a value that rounds to zero in it is kept as a stored zero), bit i of mask byte b set where column
    8 b + i holds one, and where each row's values start. ValueError when K is not a multiple of 8."""
    n, k = matrix_shape(BitmaskSparseLinear.format, "weight", weight)
    _check_columns(BitmaskSparseLinear.format, k)
    keep = weight.detach() != 0  # [N, K]
    bits = keep.view(n, k // 8, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)
    mask = bits.sum(-1, dtype=torch.uint8)  # [N, K/8]: the 8 bits are disjoint, so the sum is their OR
    counts = keep.sum(1)  # [N]
    row_offsets = torch.cumsum(counts, 0) - counts
    values = weight.detach()[keep].to(dtype or weight.dtype)
    return values.contiguous(), mask.contiguous(), row_offsets.contiguous()


def widen_bitmask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight in values' dtype: each value at its column, zeros elsewhere (exact)."""
    keep = mask_bits(mask)  # [N, K]; row-major, the set bits meet the values in order
    return torch.zeros(keep.shape, dtype=values.dtype).masked_scatter_(keep, values)


def _check_row_offsets(fmt: str, values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor) -> None:
    """Each row's values start where the previous row's end, and together they are all of values: the kernel reads
    popcount(mask row) values from each row's offset, without bounds checks."""
    counts = mask_bits(mask).sum(1)  # [N]
    expected = torch.cumsum(counts, 0) - counts
    if not torch.equal(row_offsets, expected):
        row = int((row_offsets != expected).nonzero()[0])
        raise ValueError(
            f"{fmt} tensor row_offsets[{row}] = {int(row_offsets[row])}, but the mask's rows before it hold "
            f"{int(expected[row])} set bits; each row's values must start where the previous row's end"
        )
    if int(counts.sum()) != values.numel():
        raise ValueError(
            f"{fmt} tensor values holds {values.numel()} values but the mask sets {int(counts.sum())} bits; "
            "there must be one value per set bit"
        )


@register_format
class BitmaskSparseLinear(QuantLinear):
    """y = x W^T + b with W unstructured sparse: `values` [nnz] (the nonzeros row-major, in the compute dtype),
    `mask` uint8 [N, K / 8] (bit i of byte b: column 8 b + i holds a value) and `row_offsets` int64 [N] (where each
    row's values start): compressed-tensors' "sparse-bitmask" tensors, bit for bit.

    Up to 8 bf16 rows run on cpu_bitmask's kernel (the weight widened in registers); 9+ bf16 rows on cpu_gemm over
    a packed dense copy made on first use; anything else (other dtypes, CPUs without the kernels) on a cached
    dense copy: bf16 GEMV where that kernel exists, else F.linear.
    """

    format = "sparse_bitmask"
    tensor_names = ("values", "mask", "row_offsets")
    compute_dtype_buffers = ("bias", "values")

    def __init__(
        self, values: torch.Tensor, mask: torch.Tensor, row_offsets: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        fmt = self.format
        n, k_bytes = matrix_shape(fmt, "mask", mask)
        super().__init__(8 * k_bytes, n, bias)
        if mask.dtype != torch.uint8:
            raise ValueError(f"{fmt} tensor mask must be uint8, not {mask.dtype}")
        if values.dim() != 1 or not values.dtype.is_floating_point:
            raise ValueError(f"{fmt} tensor values must be a 1-D floating point tensor, not {values.dtype} "
                             f"{list(values.shape)}")  # fmt: skip
        if row_offsets.dtype.is_floating_point or row_offsets.dtype.is_complex or row_offsets.dtype is torch.bool:
            raise ValueError(f"{fmt} tensor row_offsets must be integers, not {row_offsets.dtype}")
        check_shape(fmt, "row_offsets", row_offsets, n)
        row_offsets = row_offsets.to(torch.int64)
        _check_row_offsets(fmt, values, mask, row_offsets)
        self.register_buffer("values", values.detach().clone().contiguous())  # [nnz]
        self.register_buffer("mask", mask.detach().clone().contiguous())  # [N, K/8]
        self.register_buffer("row_offsets", row_offsets.detach().clone().contiguous())  # [N]
        self.dense = PackedCache()  # widen_bitmask of values/mask, for the paths that run on a dense weight

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> BitmaskSparseLinear:
        """The layer for a weight [N, K] (nonzeros stored in `dtype`); ValueError when K is not a multiple of 8."""
        values, mask, row_offsets = compress_bitmask(weight, dtype)
        return cls(values, mask, row_offsets, None if bias is None else bias.detach().to(dtype))

    def sparsity(self) -> float:
        """The fraction of the weight's entries that are not stored."""
        return 1.0 - self.values.numel() / (self.out_features * self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        return widen_bitmask(self.values, self.mask).float()

    def dense_weight(self) -> torch.Tensor:
        """The widened weight [N, K] in the values' dtype, kept while values and mask stay the same."""
        return self.dense.get((self.values, self.mask), widen_bitmask)

    def _pack(self, values, mask, bias) -> cpu_gemm.PackedBF16:
        return cpu_gemm.pack(widen_bitmask(values, mask), bias)

    def packed_weight(self) -> cpu_gemm.PackedBF16 | None:
        """The dense weight in cpu_gemm's panels (bf16 values on the CPU), for 9+ rows."""
        if not (self.values.dtype is torch.bfloat16 and self.values.is_cpu and cpu_gemm.is_available()):
            return None
        return self.packed.get((self.values, self.mask, self.bias), self._pack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if self.values.dtype is x.dtype and (bias is None or bias.dtype is x.dtype):
            no_grad = not (x.requires_grad and torch.is_grad_enabled())  # the kernels have no backward
            if packs_rows(x, self.mask, bias) and self.packed_weight() is not None:  # 9+ rows
                return cpu_gemm.gemm(x, self.packed.value)
            if no_grad and cpu_bitmask.should_use(x, self.values, self.mask, self.row_offsets):
                return cpu_bitmask.linear_bitmask(x, self.values, self.mask, self.row_offsets, bias)
            dense = self.dense_weight()
            if no_grad and cpu_gemv.should_use(x, dense):
                return cpu_gemv.linear_bf16(x, dense, bias)  # no VBMI2: the same numbers from the dense copy
            return F.linear(x, dense, bias)
        return self.reference_forward(x)

    def native_linear(self, packed: bool = False) -> cpu_decode.NativeLinear | None:
        packed_weight = self.packed_weight() if packed else None
        if packed and packed_weight is None:
            return None
        if cpu_bitmask.is_available():
            return cpu_decode.NativeLinear(
                cpu_decode.KIND_BITMASK,
                self.values,
                bias=self.bias,
                mask=self.mask,
                row_offsets=self.row_offsets,
                packed=packed_weight,
            )
        # Without the sparse kernel the loop runs the dense copy on the bf16 one (same numbers, dense bytes).
        return cpu_decode.NativeLinear(cpu_decode.KIND_BF16, self.dense_weight(), bias=self.bias, packed=packed_weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtype={self.values.dtype}, sparsity={self.sparsity():.3f}"


def to_bitmask(linear: torch.nn.Linear, dtype: torch.dtype = torch.bfloat16) -> BitmaskSparseLinear:
    """A pruned nn.Linear as a BitmaskSparseLinear (ValueError when in_features is not a multiple of 8)."""
    return BitmaskSparseLinear.from_dense(linear.weight, linear.bias, dtype)
