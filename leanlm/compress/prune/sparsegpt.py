"""SparseGPT (Frantar & Alistarh 2023): one-shot pruning as optimal brain surgeon over the layer Hessian.

Columns are fixed left to right (hessian.obs_sweep, the same sweep GPTQ runs): a pruned weight's removal is
compensated by updating the columns not yet fixed, through H^-1's Cholesky factor, with lazy block updates.
The mask is chosen adaptively inside the sweep from the weights as they are by then, scored w^2 / [U_ii]^2
(the OBS saliency): per block of `block_size` columns over the whole block for unstructured sparsity, per
group of m columns for N:M. With `bits` set, the kept weights are quantized in the same sweep (the paper's
joint sparsification + quantization) and the linear becomes a quantized runtime module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.compress.base import NEEDS_HESSIAN, NEEDS_STATS, MethodConfig, register_method
from leanlm.compress.hessian import Select, inverse_cholesky_upper, obs_sweep, prepare_hessian
from leanlm.compress.prune.owl import LayerProfile
from leanlm.compress.prune.pruner import Pruner
from leanlm.compress.prune.sparsity import SparsityScheme, lowest_mask, nm_mask
from leanlm.compress.quantize.gptq import GPTQConfig, gptq_quantize
from leanlm.compress.quantize.int_scheme import build_module
from leanlm.compress.quantize.linear_quantizer import LinearQuantizer
from leanlm.model.sparsity_mask import pruned_mask


@dataclass(frozen=True)
class SparseGPTConfig(MethodConfig, SparsityScheme, LayerProfile):
    block_size: int = 128  # columns per lazy update, and per unstructured mask choice
    damp_percent: float = 0.01  # of the mean Hessian diagonal
    bits: int | None = None  # joint prune + quantize to this many bits (GPTQ's grid), or None: prune only
    group_size: int | None = 64  # quantization group (with bits)
    symmetric: bool | None = None  # quantization grid (with bits); None: the IntScheme default for the bits

    name = "sparsegpt"

    def __post_init__(self) -> None:
        SparsityScheme.__post_init__(self)
        self.check_profile(self.sparsity, self.pattern)
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.nm is not None and self.block_size % self.nm[1]:
            raise ValueError(f"block_size {self.block_size} must be a multiple of the pattern's m = {self.nm[1]}")
        if not 0 <= self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in [0, 1), got {self.damp_percent}")
        if self.bits is not None:
            self.quantization()  # validates bits, group size and grid

    def quantization(self) -> GPTQConfig:
        """The GPTQ settings of the joint quantization: no act-order (N:M groups are runs of input columns,
        and the mask is chosen in column order), blocks as the mask's."""
        return GPTQConfig(
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            act_order=False,
            block_size=self.block_size,
            damp_percent=self.damp_percent,
            shrink_search=False,
            ignore=self.ignore,
        )


def sparsegpt_select(scheme: SparsityScheme) -> Select:
    """SparseGPT's adaptive mask choice for obs_sweep, scored w^2 / U_ii^2 on the block's current weights."""
    nm = scheme.nm

    def select(i: int, w_blk: torch.Tensor, u_blk: torch.Tensor, p_blk: torch.Tensor) -> None:
        d = torch.diagonal(u_blk)
        if nm is None and i == 0:
            p_blk.logical_or_(lowest_mask(w_blk.pow(2) / d.pow(2), scheme.sparsity, per_row=False))
        elif nm is not None and i % nm[1] == 0:
            cols = slice(i, i + nm[1])
            p_blk[:, cols].logical_or_(nm_mask(w_blk[:, cols].pow(2) / d[cols].pow(2), *nm))

    return select


def sparsegpt_prune(
    weight: torch.Tensor, hessian: torch.Tensor, cfg: SparseGPTConfig, pruned: torch.Tensor | None = None
) -> torch.Tensor:
    """SparseGPT of weight [N, K] given H [K, K] -> the pruned and updated weight [N, K] float32; pure.
    pruned [N, K]: weights already zero that must stay so (counted as part of each block's choice)."""
    h, w = prepare_hessian(hessian, weight, cfg.damp_percent)
    mask = torch.zeros(w.shape, dtype=torch.bool, device=w.device) if pruned is None else pruned.clone()
    return obs_sweep(w, inverse_cholesky_upper(h), cfg.block_size, mask, sparsegpt_select(cfg)).float()


class _JointQuantizer(LinearQuantizer):
    """SparseGPT with bits: each linear becomes the quantized runtime module of the joint sweep, pruned to
    `scheme` (set per layer by SparseGPT)."""

    scheme: SparsityScheme

    def quantize_linear(self, linear, inputs):
        cfg = self.config.quantization()
        result = gptq_quantize(
            linear.weight.float(), inputs.hessian, cfg, pruned_mask(linear), sparsegpt_select(self.scheme)
        )
        return build_module(result.codes, result.qparams, cfg, linear.bias)


@register_method(SparseGPTConfig)
class SparseGPT(Pruner):
    needs = frozenset({NEEDS_HESSIAN, NEEDS_STATS})

    def __init__(self, config: SparseGPTConfig) -> None:
        super().__init__(config)
        self.joint = _JointQuantizer(config) if config.bits is not None else None

    def prune_linear(self, name, linear, inputs, scheme):
        return sparsegpt_prune(linear.weight.float(), inputs.hessian, scheme, pruned_mask(linear))

    def _prune(self, parent, name, full, inputs, scheme):
        if self.joint is None:
            return super()._prune(parent, name, full, inputs, scheme)
        if isinstance(module := parent.get_submodule(name), torch.nn.Linear):
            self.config.check_shape(module.in_features)
        self.joint.scheme = scheme
        return self.joint._replace(parent, name, full, inputs)
