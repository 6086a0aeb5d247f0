"""Slicing a linear layer's weight format for tensor parallelism (Megatron-LM, Shoeybi et al. 2019): a
column-parallel shard holds a slice of the output features, a row-parallel shard a slice of the input features
(its partial outputs summed across ranks give the layer's output)."""

from __future__ import annotations

import torch

COLUMN, ROW = 0, 1  # the weight [N, K]'s axis a shard splits: out_features (column-parallel) or in_features (row)


def part(
    size: int, axis: int, rank: int, world: int, unit: int, fmt: str, sizes: tuple[int, ...] | None = None
) -> slice:
    """rank's slice of `size` features along `axis`: equal parts, or `sizes[rank]` features after the ranks before
    it (uneven parts, as attention heads split by KV group need); cut only at multiples of `unit` (a quant group, a
    2:4 group, a packed byte). ValueError saying why when it cannot be cut so."""
    check_axis(axis)
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"shard needs 0 <= rank < world, got rank={rank!r}, world={world!r}")
    what = "out_features" if axis == COLUMN else "in_features"
    if sizes is not None:
        if len(sizes) != world or sum(sizes) != size or any(n <= 0 for n in sizes):
            raise ValueError(f"{fmt}: shard sizes {sizes} must be {world} positive parts summing to {what}={size}")
        if any(n % unit for n in sizes):
            raise ValueError(
                f"{fmt}: shard sizes {sizes} of {what} cut the format's indivisible block of {unit} features: "
                f"choose parts that are multiples of {unit}"
            )
        start = sum(sizes[:rank])
        return slice(start, start + sizes[rank])
    if size % world or (size // world) % unit:
        raise ValueError(
            f"{fmt}: {what}={size} does not split into {world} equal parts of a multiple of {unit} (the format's "
            f"indivisible block along it): choose a world size whose parts keep whole blocks"
        )
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def groups(t: torch.Tensor, cols: slice, group_size: int) -> torch.Tensor:
    """The per-group columns [N, G'] of t [N, G] that input columns `cols` (whole groups) use."""
    return t[:, cols.start // group_size : cols.stop // group_size]


def scaled(cols: slice, factor: int) -> slice:
    """`cols` of the dense input in a tensor holding `factor` columns per entry (codes two per byte, mask bytes)."""
    return slice(cols.start // factor, cols.stop // factor)


def row_bias(bias: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    """A row-parallel shard's bias: rank 0 keeps it, so the sum over ranks adds it once."""
    return bias if rank == 0 else None


def refuse_row_split(fmt: str, reason: str) -> ValueError:
    return ValueError(f"{fmt} cannot be split along in_features (row-parallel): {reason}; shard it by columns")


def check_axis(axis: int) -> None:
    if axis not in (COLUMN, ROW) or isinstance(axis, bool):
        raise ValueError(f"shard axis must be COLUMN ({COLUMN}, split out_features) or ROW ({ROW}), got {axis!r}")
