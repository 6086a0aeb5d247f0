"""Unstructured sparse linear layers (any pattern of zeros, as magnitude / Wanda / SparseGPT pruning leave at a
fraction), stored in compressed-tensors' "sparse-bitmask" layout: the nonzeros row-major, a bit per weight and each
row's start, so batch-1 decode reads 2 bytes per nonzero plus 1/8 byte per weight (36% of dense bf16 at 70%
zeros). The pruning methods that produce such weights live in leanlm.compress.
"""

from __future__ import annotations

import torch

from leanlm.kernels import cpu_bitmask
from leanlm.kernels.native_linear import NativeCall
from leanlm.model.linear.base import register_format
from leanlm.model.linear.checks import check_shape, matrix_shape
from leanlm.model.linear.shard import COLUMN, scaled
from leanlm.model.linear.sparse24 import mask_bits
from leanlm.model.linear.widened import WidenedSparseLinear

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
    bits = keep.view(n, k // 8, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8, device=keep.device)
    mask = bits.sum(-1, dtype=torch.uint8)  # [N, K/8]: the 8 bits are disjoint, so the sum is their OR
    counts = keep.sum(1)  # [N]
    row_offsets = torch.cumsum(counts, 0) - counts
    values = weight.detach()[keep].to(dtype or weight.dtype)
    return values.contiguous(), mask.contiguous(), row_offsets.contiguous()


def widen_bitmask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight in values' dtype: each value at its column, zeros elsewhere (exact)."""
    keep = mask_bits(mask)  # [N, K]; row-major, the set bits meet the values in order
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).masked_scatter_(keep, values)


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
class BitmaskSparseLinear(WidenedSparseLinear):
    """y = x W^T + b with W unstructured sparse: `values` [nnz] (the nonzeros row-major, in the compute dtype),
    `mask` uint8 [N, K / 8] (bit i of byte b: column 8 b + i holds a value) and `row_offsets` int64 [N] (where each
    row's values start): compressed-tensors' "sparse-bitmask" tensors, bit for bit.

    Up to 8 bf16 rows run on cpu_bitmask's kernel (the weight widened in registers); 9+ bf16 rows on cpu_gemm over
    a packed dense copy made on first use; anything else (other dtypes, CPUs without the kernels) on a cached
    dense copy: bf16 GEMV where that kernel exists, else F.linear.
    """

    format = "sparse_bitmask"
    tensor_names = ("values", "mask", "row_offsets")
    widen = staticmethod(widen_bitmask)

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

    def shard_unit(self, axis: int) -> int:
        return 1 if axis == COLUMN else 8  # a mask byte holds 8 columns

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        keep = mask_bits(self.mask)  # [N, K]; the set bits meet the values row-major
        index = torch.full(keep.shape, -1, dtype=torch.int64, device=keep.device)
        index[keep] = torch.arange(self.values.numel(), device=keep.device)  # each weight's place in values
        sub, mask = (index[cut], self.mask[cut]) if axis == COLUMN else (index[:, cut], self.mask[:, scaled(cut, 8)])
        counts = (sub >= 0).sum(1)  # [N'] values per kept row
        return {"values": self.values[sub[sub >= 0]], "mask": mask, "row_offsets": torch.cumsum(counts, 0) - counts}

    def sparse_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.values, self.mask, self.row_offsets

    def kernel_should_use(self, x: torch.Tensor) -> bool:
        return cpu_bitmask.should_use(x, self.values, self.mask, self.row_offsets)

    def kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_bitmask.linear_bitmask(x, self.values, self.mask, self.row_offsets, bias)

    def native_sparse(self) -> NativeCall | None:
        if not cpu_bitmask.is_available():
            return None
        return cpu_bitmask.native_call(self.values, self.mask, self.row_offsets, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={self.sparsity():.3f}"


def to_bitmask(linear: torch.nn.Linear, dtype: torch.dtype = torch.bfloat16) -> BitmaskSparseLinear:
    """A pruned nn.Linear as a BitmaskSparseLinear (ValueError when in_features is not a multiple of 8)."""
    return BitmaskSparseLinear.from_dense(linear.weight, linear.bias, dtype)
