"""Checks of a weight format's saved tensors: shapes, counts, group sizes and index tensors, with messages
naming the format and the tensor."""

from __future__ import annotations

import torch

# Saved tensors are untrusted input: the native kernels index codes, scales, mins and perm by the layer's
# N, K and group size without bounds checks, so every shape and index is checked when a layer is built.


def matrix_shape(fmt: str, name: str, t: torch.Tensor) -> tuple[int, int]:
    if t.dim() != 2 or 0 in t.shape:
        raise ValueError(f"{fmt} tensor {name} has shape {list(t.shape)}; expected a non-empty matrix")
    return int(t.shape[0]), int(t.shape[1])


def check_shape(fmt: str, name: str, t: torch.Tensor | None, *shape: int) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{fmt} tensor {name} has shape {list(t.shape)}; expected {list(shape)}")


def check_numel(fmt: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.numel() != n:
        raise ValueError(f"{fmt} tensor {name} has {t.numel()} values (shape {list(t.shape)}); expected {n}")


def check_group_size(fmt: str, group_size, k: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 or k % group_size:
        raise ValueError(f"{fmt} group_size {group_size!r} must be a positive integer dividing in_features={k}")


def check_indices(fmt: str, name: str, t: torch.Tensor, k: int, permutation: bool) -> torch.Tensor:
    """int64 copy of an index tensor whose values lie in [0, k) without repeats (all of them when a permutation)."""
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype is torch.bool:
        raise ValueError(f"{fmt} tensor {name} must be a 1-D integer tensor, got {t.dtype} {list(t.shape)}")
    idx = t.long()
    if permutation and idx.numel() != k:
        raise ValueError(f"{fmt} tensor {name} has {idx.numel()} entries; a permutation of in_features needs {k}")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= k):
        raise ValueError(
            f"{fmt} tensor {name} holds indices outside [0, {k}) (min {int(idx.min())}, max {int(idx.max())})"
        )
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{fmt} tensor {name} repeats an index; each input column may appear once")
    return idx.contiguous()
