"""The mark a pruning step leaves on a float linear: `sparsity_mask`, [N, K] bool, True where it zeroed the weight.
It is a plain attribute, not state-dict tensor: later steps read it (a quantizer keeps those weights at zero) and
a writer tells a pruned linear from a dense one by it (formats/compressed_tensors.py)."""

from __future__ import annotations

import torch
from torch import nn

MASK_ATTR = "sparsity_mask"


def pruned_mask(linear: nn.Module) -> torch.Tensor | None:
    """[N, K] bool, True where an earlier pruning step zeroed the weight; None when it was not pruned."""
    return getattr(linear, MASK_ATTR, None)
