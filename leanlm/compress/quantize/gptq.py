"""GPTQ (Frantar et al. 2022): quantize a layer's columns one at a time, spreading each column's rounding
error over the not-yet-quantized columns through the inverse Hessian of the layer's inputs; lazy block
updates, act-order (columns by decreasing Hessian diagonal) and groups."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from leanlm.compress.base import NEEDS_HESSIAN, NEEDS_STATS, MethodConfig, register_method
from leanlm.compress.hessian import Select, inverse_cholesky_upper, obs_sweep, prepare_hessian
from leanlm.compress.prune.sparsity import satisfies_nm
from leanlm.compress.quantize.int_scheme import IntScheme, build_module
from leanlm.compress.quantize.linear_quantizer import LinearQuantizer
from leanlm.model.quantized.numerics import QParams, QuantSpec, compute_qparams, quantize, shrink_qparams
from leanlm.model.sparsity_mask import pruned_mask


@dataclass(frozen=True)
class GPTQConfig(MethodConfig, IntScheme):
    damp_percent: float = 0.01  # of the mean Hessian diagonal, added to the diagonal
    block_size: int = 128  # columns per lazy batch update (rounded to a multiple of group_size)
    act_order: bool = True  # quantize columns by decreasing H_ii (the "desc_act" of GPTQ checkpoints)
    shrink_search: bool = True  # each group's range shrunk to the least |w - q|^2.4 (quant.shrink_qparams)
    true_sequential: bool = False  # fit each linear group to inputs that the layer's quantized groups produce
    # Groups of input columns in their own order with parameters fixed before the sweep (AutoGPTQ's static_groups):
    # act-order then needs no stored permutation. Always used for 2:4-pruned layers under act-order, so their
    # groups stay whole 2:4 groups and the layer packs into the 2:4 int4 format.
    static_groups: bool = False

    name = "gptq"

    def __post_init__(self) -> None:
        IntScheme.__post_init__(self)
        if not 0 <= self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in [0, 1), got {self.damp_percent}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


@dataclass(frozen=True)
class GPTQResult:
    """One quantized weight: integer codes in quantization (act-order) column order and their parameters."""

    codes: torch.Tensor  # [N, K] int8/uint8, columns in `perm` order
    qparams: QParams  # grouped over the permuted columns (or per channel)
    perm: torch.Tensor | None  # [K] long: stored column j is input column perm[j]; None without act-order
    dequantized: torch.Tensor  # [N, K] float32 in the original column order


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    cfg: GPTQConfig,
    pruned: torch.Tensor | None = None,
    select: Select | None = None,
) -> GPTQResult:
    """GPTQ of weight [N, K] given H [K, K]; pure function. pruned [N, K] bool: weights an earlier pruning
    step zeroed, kept at zero (their OBS error spread like any other); select: SparseGPT's mask choice made
    inside the same sweep (joint prune + quantize, sparsegpt.py)."""
    spec = cfg.spec(weight.shape[1])
    h, w = prepare_hessian(hessian, weight, cfg.damp_percent)
    n, k = w.shape
    pruned = torch.zeros(n, k, dtype=torch.bool, device=w.device) if pruned is None else pruned.clone()
    perm = None
    group = spec.group_size
    find_qparams = shrink_qparams if cfg.shrink_search else compute_qparams
    col_spec = QuantSpec(spec.bits, spec.symmetric)  # one column [N, 1] (or one group) against per-row parameters
    static = None  # [G] QParams of the input-order groups, from the weights before the sweep
    if cfg.static_groups and group is not None:
        masked = w.masked_fill(pruned, 0.0)
        static = [find_qparams(masked[:, g : g + group], col_spec) for g in range(0, k, group)]
    if cfg.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h, pruned = w[:, perm], h[perm][:, perm], pruned[:, perm]
    u = inverse_cholesky_upper(h)  # [K, K]
    block = cfg.block_size if group is None else max(group, cfg.block_size // group * group)
    codes = torch.empty(n, k, dtype=torch.int16, device=w.device)
    scales, zeros = [], []
    # per channel: fixed up front, as in GPTQ; per group: from the group's already-updated columns
    current = [find_qparams(w.masked_fill(pruned, 0.0), spec) if group is None else None]

    def round_column(col: int, x: torch.Tensor, w_blk: torch.Tensor, p_blk: torch.Tensor, i: int) -> torch.Tensor:
        if static is not None:
            current[0] = static[(col if perm is None else int(perm[col])) // group]
        elif group is not None and col % group == 0:
            qp = find_qparams(w_blk[:, i : i + group].masked_fill(p_blk[:, i : i + group], 0.0), col_spec)
            scales.append(qp.scale)
            zeros.append(qp.zero)
            current[0] = qp
        qp = current[0]
        c = quantize(x, qp, col_spec)  # a pruned entry is 0, on every grid: its code dequantizes to 0
        codes[:, col] = c[:, 0].to(torch.int16)
        return (c.double() - (qp.zero if qp.zero is not None else 0)) * qp.scale

    q_all = obs_sweep(w, u, block, pruned, select, round_column)
    if static is not None:
        qparams = QParams(
            torch.cat([qp.scale for qp in static], dim=1).float().unsqueeze(-1),
            None if spec.symmetric else torch.cat([qp.zero for qp in static], dim=1).float().unsqueeze(-1),
        )
    elif group is not None:
        scale = torch.cat(scales, dim=1).float()  # [N, G]
        zero = None if spec.symmetric else torch.cat(zeros, dim=1).float()
        qparams = QParams(scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1))
    else:
        qp = current[0]
        qparams = QParams(qp.scale.float(), None if qp.zero is None else qp.zero.float())
    dequantized = q_all.float()
    if perm is not None:
        dequantized = torch.empty_like(dequantized).index_copy_(1, perm, dequantized)
        if static is not None:  # codes back in input order, where their groups are: nothing to store
            codes, perm = torch.empty_like(codes).index_copy_(1, perm, codes), None
    dtype = torch.int8 if spec.symmetric or spec.bits < 8 else torch.uint8
    return GPTQResult(codes.to(dtype), qparams, perm, dequantized)


def layer_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """The GPTQ objective: tr((W - W') H (W - W')^T) = (2/n) |X W^T - X W'^T|^2 summed over rows."""
    d = weight.double() - approx.double()
    return torch.einsum("nk,kl,nl->", d, hessian.double(), d).item()


@register_method(GPTQConfig)
class GPTQ(LinearQuantizer):
    needs = frozenset({NEEDS_HESSIAN, NEEDS_STATS})

    @property
    def is_sequential(self) -> bool:
        return self.config.true_sequential

    def quantize_linear(self, linear, inputs):
        cfg = self.config
        # act-order permutes input columns, which only the group-wise 2-4 bit layers can carry
        act_order = cfg.act_order and cfg.act_bits is None and cfg.bits <= 4
        pruned = pruned_mask(linear)
        static = cfg.static_groups or (act_order and pruned is not None and satisfies_nm(~pruned, 2, 4))
        run_cfg = dataclasses.replace(cfg, act_order=act_order, static_groups=static)
        result = gptq_quantize(linear.weight.float(), inputs.hessian, run_cfg, pruned)
        return build_module(result.codes, result.qparams, cfg, linear.bias, result.perm)
