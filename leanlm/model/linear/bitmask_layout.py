"""The sparse tensor layouts of compressed-tensors (the format llm-compressor writes and vLLM and HF
transformers read), converted to and from ours.

- "sparse-24-bitmask": per weight `compressed` [N, K/2] (the 2 kept values of every group of 4, in column
  order), `bitmask` uint8 [N, K/8] (numpy.packbits of the keep mask along K, little bit order: byte b, bit i =
  column 8b + i) and `shape` int64 [[N], [K]]. This is Sparse24Linear's own layout (values, mask) bit for bit.
- "sparse-bitmask" (unstructured): `compressed` 1-D (every nonzero, row-major), `bitmask` uint8
  [N, ceil(K/8)] (same packing), `row_offsets` int64 [N] (where each row's values start), `shape` int64 [N, K].
  With K a multiple of 8 this is BitmaskSparseLinear's layout (values, mask, row_offsets) bit for bit.
"""

from __future__ import annotations

import torch

from leanlm.model.linear.bitmask import BitmaskSparseLinear, is_sparse_enough
from leanlm.model.linear.sparse24 import Sparse24Linear

_BITS = 2 ** torch.arange(8, dtype=torch.int32)  # bit i of a byte: column 8b + i


def pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """keep [N, K] bool -> uint8 [N, ceil(K / 8)], little bit order along K (numpy.packbits(..., 'little'))."""
    n, k = keep.shape
    padded = torch.zeros(n, -(-k // 8) * 8, dtype=torch.int32)
    padded[:, :k] = keep.to(torch.int32)
    return (padded.view(n, -1, 8) * _BITS).sum(-1).to(torch.uint8)


def unpack_bits(bits: torch.Tensor, columns: int) -> torch.Tensor:
    """uint8 [N, ceil(K / 8)] -> keep [N, K] bool."""
    return ((bits.to(torch.int32).unsqueeze(-1) & _BITS) != 0).reshape(bits.shape[0], -1)[:, :columns]


def sparse24_tensors(layer: Sparse24Linear) -> dict[str, torch.Tensor]:
    """A 2:4 layer's weight as compressed-tensors' sparse-24-bitmask tensors (suffixes of the module name)."""
    n, k = layer.out_features, layer.in_features
    return {"compressed": layer.values, "bitmask": layer.mask, "shape": torch.tensor([[n], [k]], dtype=torch.int64)}


def from_sparse24_tensors(tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None) -> Sparse24Linear:
    """sparse-24-bitmask tensors -> Sparse24Linear; ValueError when they are not a 2:4 weight of their shape (the
    layer checks that every group keeps exactly 2)."""
    n, k = (int(v) for v in _shape(tensors, 2))
    values, mask = tensors["compressed"], tensors["bitmask"]
    if tuple(values.shape) != (n, k // 2) or tuple(mask.shape) != (n, k // 8) or mask.dtype != torch.uint8:
        raise ValueError(
            f"sparse-24-bitmask tensors compressed {list(values.shape)}, bitmask {list(mask.shape)} {mask.dtype} do "
            f"not fit shape [{n}, {k}]: expected [{n}, {k // 2}] and uint8 [{n}, {k // 8}]"
        )
    return Sparse24Linear(values, mask, bias)


def bitmask_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """An unstructured sparse weight [N, K] as compressed-tensors' sparse-bitmask tensors."""
    keep = weight != 0
    counts = keep.sum(dim=1)
    return {
        "compressed": weight[keep],
        "bitmask": pack_bits(keep),
        "row_offsets": torch.cumsum(counts, 0) - counts,
        "shape": torch.tensor(list(weight.shape), dtype=torch.int64),
    }


def bitmask_layer_tensors(layer: BitmaskSparseLinear) -> dict[str, torch.Tensor]:
    """An unstructured sparse layer's weight as compressed-tensors' sparse-bitmask tensors (its own, unchanged)."""
    n, k = layer.out_features, layer.in_features
    return {
        "compressed": layer.values,
        "bitmask": layer.mask,
        "row_offsets": layer.row_offsets,
        "shape": torch.tensor([n, k], dtype=torch.int64),
    }


def from_bitmask_layer_tensors(
    tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None
) -> BitmaskSparseLinear | None:
    """sparse-bitmask tensors -> BitmaskSparseLinear when its kernel pays (is_sparse_enough) and fits
    (K a multiple of 8); None otherwise (load the dense weight: from_bitmask_tensors). ValueError when the tensors
    do not agree with each other (the layer checks row_offsets against the mask's popcounts)."""
    n, k = (int(v) for v in _shape(tensors, 2))
    values, bits = tensors["compressed"], tensors["bitmask"]
    if k % 8 or values.dim() != 1 or not is_sparse_enough(n * k - values.numel(), n, k):
        return None
    if tuple(bits.shape) != (n, k // 8):
        raise ValueError(f"sparse-bitmask bitmask {list(bits.shape)} does not fit shape [{n}, {k}]")
    offsets = tensors.get("row_offsets")
    if offsets is None:  # optional in compressed-tensors: each row starts where the previous one ends
        counts = unpack_bits(bits, k).sum(1)
        offsets = torch.cumsum(counts, 0) - counts
    return BitmaskSparseLinear(values, bits, offsets, bias)


def from_bitmask_tensors(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """sparse-bitmask tensors -> the dense weight [N, K]; ValueError when they do not agree with each other."""
    n, k = (int(v) for v in _shape(tensors, 2))
    bits, values = tensors["bitmask"], tensors["compressed"]
    if tuple(bits.shape) != (n, -(-k // 8)) or bits.dtype != torch.uint8:
        raise ValueError(f"sparse-bitmask bitmask {list(bits.shape)} {bits.dtype} does not fit shape [{n}, {k}]")
    keep = unpack_bits(bits, k)
    if values.dim() != 1 or values.numel() != int(keep.sum()):
        raise ValueError(f"sparse-bitmask holds {values.numel()} values for a mask of {int(keep.sum())} set bits")
    weight = torch.zeros(n, k, dtype=values.dtype)
    weight[keep] = values
    return weight


def _shape(tensors: dict[str, torch.Tensor], dims: int) -> list[int]:
    missing = [name for name in ("compressed", "bitmask", "shape") if name not in tensors]
    if missing:
        raise ValueError(f"compressed-tensors sparse weight lacks {missing}")
    shape = tensors["shape"].reshape(-1).tolist()
    if len(shape) != dims or min(shape) < 1:
        raise ValueError(f"compressed-tensors sparse weight has shape {shape}; expected {dims} positive sizes")
    return shape
