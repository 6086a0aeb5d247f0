"""2:4 semi-structured sparse linear layers (NVIDIA's Ampere pattern, Mishra et al. 2021: at most 2 nonzeros in
every group of 4 consecutive input columns of each output row), stored as the kept values plus a bitmask so batch-1
decode reads 56% of the dense bf16 bytes. The pruning methods that produce such weights live in leanlm.compress.
"""

from __future__ import annotations

import torch

from leanlm.kernels import cpu_sparse
from leanlm.kernels.native_linear import NativeCall
from leanlm.model.linear import tensor_cores
from leanlm.model.linear.base import register_format
from leanlm.model.linear.checks import check_shape, matrix_shape
from leanlm.model.linear.shard import COLUMN, scaled
from leanlm.model.linear.widened import WidenedSparseLinear
from leanlm.model.packed_cache import PackedCache

GROUP = 4  # input columns per group, of which KEPT are stored
KEPT = 2


def mask_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [N, K] from the bitmask uint8 [N, K / 8]: bit i of byte b marks input column 8 b + i (so group 2 b is
    the low nibble, group 2 b + 1 the high one)."""
    bits = torch.arange(8, dtype=torch.uint8, device=mask.device)  # bit i of a byte: column i of its two groups
    return ((mask[..., None] >> bits) & 1).bool().flatten(-2)


def compress_24(weight: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, K / 2], mask uint8 [N, K / 8]) of a 2:4 sparse weight [N, K]: each group's nonzeros in column
    order, a group with fewer than 2 keeping zeros at its first zero columns so every group stores exactly 2.
    Raises ValueError naming the first group with more than 2 nonzeros, or when K is not a multiple of 8."""
    n, k = matrix_shape(Sparse24Linear.format, "weight", weight)
    if k % 8:
        raise ValueError(
            f"a 2:4 sparse weight needs in_features divisible by 8 (one mask byte holds two groups of 4), "
            f"got {k}: keep this layer dense or pad its input columns with zeros to {k + 8 - k % 8}"
        )
    groups = weight.detach().reshape(n, k // GROUP, GROUP)  # [N, K/4, 4]
    nonzero = groups != 0
    counts = nonzero.sum(-1)  # [N, K/4]
    if (counts > KEPT).any():
        row, group = (int(i) for i in (counts > KEPT).nonzero()[0])
        raise ValueError(
            f"weight row {row}, input columns {GROUP * group}-{GROUP * group + 3} hold {int(counts[row, group])} "
            f"nonzeros; 2:4 sparsity allows at most {KEPT} per group of {GROUP}: prune the layer to 2:4 first "
            "(leanlm.compress) or keep it dense"
        )
    # Rank columns: nonzeros first, then by column; the best 2 of each group, put back in column order.
    order = torch.arange(GROUP - 1, -1, -1, device=weight.device)  # earlier columns win ties among zeros
    keep = (nonzero.to(torch.int64) * GROUP + order).topk(KEPT, dim=-1).indices.sort(dim=-1).values  # [N, K/4, 2]
    values = groups.gather(-1, keep).reshape(n, k // 2)
    nibbles = (torch.ones_like(keep) << keep).sum(-1)  # [N, K/4]: 4 bits, 2 set
    mask = (nibbles[:, 0::2] | (nibbles[:, 1::2] << GROUP)).to(torch.uint8)  # [N, K/8]
    return values.to(dtype or values.dtype).contiguous(), mask.contiguous()


def check_mask(fmt: str, mask: torch.Tensor, n: int, k: int) -> None:
    """ValueError unless mask is uint8 [n, k / 8] with exactly 2 of every 4 bits set. The kernels expand as many
    values as a group has bits set: a nibble without exactly 2 would read past the row (checkpoints are untrusted
    input)."""
    if mask.dtype != torch.uint8:
        raise ValueError(f"{fmt} tensor mask must be uint8, not {mask.dtype}")
    check_shape(fmt, "mask", mask, n, k // 8)
    counts = mask_bits(mask).view(n, k // GROUP, GROUP).sum(-1)
    if (counts != KEPT).any():
        row, group = (int(i) for i in (counts != KEPT).nonzero()[0])
        raise ValueError(
            f"{fmt} tensor mask marks {int(counts[row, group])} columns in row {row}, group {group}; every "
            f"group of {GROUP} must mark exactly {KEPT}"
        )


def widen_24(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight in values' dtype: each kept value at its column, zeros elsewhere (exact)."""
    keep = mask_bits(mask)  # [N, K]; row-major, the set bits meet the values in order (2 per group)
    return torch.zeros(keep.shape, dtype=values.dtype, device=values.device).masked_scatter_(keep, values)


@register_format
class Sparse24Linear(WidenedSparseLinear):
    """y = x W^T + b with W 2:4 sparse along K: `values` [N, K / 2] (the kept values, in the compute dtype) and
    `mask` [N, K / 8] (4 bits per group of 4 input columns, exactly 2 set: where the values go).

    Up to 8 bf16 rows run on cpu_sparse's kernel (the weight widened in registers); 9+ bf16 rows on cpu_gemm over
    a packed dense copy made on first use; on a CUDA GPU, products large enough to pay for it on the sparse tensor
    cores (tensor_cores.py); anything else (other dtypes, CPUs without the kernels) on a cached dense copy: bf16
    GEMV where that kernel exists, else F.linear.
    """

    format = "sparse24"
    tensor_names = ("values", "mask")
    widen = staticmethod(widen_24)

    def __init__(self, values: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, half_k = matrix_shape(self.format, "values", values)
        super().__init__(2 * half_k, n, bias)
        fmt, k = self.format, 2 * half_k
        if not values.dtype.is_floating_point:
            raise ValueError(f"{fmt} tensor values must be floating point, not {values.dtype}")
        if k % 8:
            raise ValueError(f"{fmt} in_features (2 x values' columns) must be a multiple of 8, got {k}")
        check_mask(fmt, mask, n, k)
        self.register_buffer("values", values.detach().clone().contiguous())  # [N, K/2]
        self.register_buffer("mask", mask.detach().clone().contiguous())  # [N, K/8]
        self.semi_structured = PackedCache()  # the weight on CUDA's sparse tensor cores, made on first use

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> Sparse24Linear:
        """The layer for a 2:4 sparse weight [N, K] (values stored in `dtype`); ValueError if it is not 2:4."""
        values, mask = compress_24(weight, dtype)
        return cls(values, mask, None if bias is None else bias.detach().to(dtype))

    def shard_unit(self, axis: int) -> int:
        return 1 if axis == COLUMN else 8  # a mask byte holds two groups of 4 columns

    def shard_tensors(self, axis: int, cut: slice) -> dict[str, torch.Tensor]:
        if axis == COLUMN:
            return {"values": self.values[cut], "mask": self.mask[cut]}
        return {"values": self.values[:, scaled(cut, 2)], "mask": self.mask[:, scaled(cut, 8)]}

    def sparse_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.values, self.mask

    def kernel_should_use(self, x: torch.Tensor) -> bool:
        return cpu_sparse.should_use(x, self.values, self.mask)

    def kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_sparse.linear_sparse24(x, self.values, self.mask, bias)

    def tensor_core_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        if not tensor_cores.should_use(x, self.values):
            return None
        return self.semi_structured.get((self.values, self.mask), lambda v, m: tensor_cores.compress(widen_24(v, m)))

    def native_sparse(self) -> NativeCall | None:
        return cpu_sparse.native_call(self.values, self.mask, self.bias) if cpu_sparse.is_available() else None


def to_sparse24(linear: torch.nn.Linear, dtype: torch.dtype = torch.bfloat16) -> Sparse24Linear:
    """A 2:4-pruned nn.Linear as a Sparse24Linear (ValueError if its weight is not 2:4)."""
    return Sparse24Linear.from_dense(linear.weight, linear.bias, dtype)
