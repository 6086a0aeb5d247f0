"""GPTQ (Frantar et al. 2022): quantize a layer's columns one at a time, spreading each column's rounding
error over the not-yet-quantized columns through the inverse Hessian of the layer's inputs; lazy block
updates, act-order (columns by decreasing Hessian diagonal) and groups."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from leanlm.compress.base import NEEDS_HESSIAN, NEEDS_STATS, MethodConfig, register_method
from leanlm.compress.hessian import inverse_cholesky_upper, prepare_hessian
from leanlm.compress.int_scheme import IntScheme, build_module
from leanlm.compress.linear_quantizer import LinearQuantizer
from leanlm.model.quantized.numerics import QParams, QuantSpec, compute_qparams, quantize, shrink_qparams


@dataclass(frozen=True)
class GPTQConfig(MethodConfig, IntScheme):
    damp_percent: float = 0.01  # of the mean Hessian diagonal, added to the diagonal
    block_size: int = 128  # columns per lazy batch update (rounded to a multiple of group_size)
    act_order: bool = True  # quantize columns by decreasing H_ii (the "desc_act" of GPTQ checkpoints)
    shrink_search: bool = True  # each group's range shrunk to the least |w - q|^2.4 (quant.shrink_qparams)
    true_sequential: bool = False  # fit each linear group to inputs that the layer's quantized groups produce

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


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: GPTQConfig) -> GPTQResult:
    """GPTQ of weight [N, K] given H [K, K]; pure function."""
    spec = cfg.spec(weight.shape[1])
    h, w = prepare_hessian(hessian, weight, cfg.damp_percent)
    n, k = w.shape
    perm = None
    if cfg.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    u = inverse_cholesky_upper(h)  # [K, K]
    group = spec.group_size
    block = cfg.block_size if group is None else max(group, cfg.block_size // group * group)
    codes = torch.empty(n, k, dtype=torch.int16)
    q_all = torch.empty_like(w)
    scales, zeros = [], []
    find_qparams = shrink_qparams if cfg.shrink_search else compute_qparams
    qp = find_qparams(w, spec) if group is None else None  # per channel: fixed up front, as in GPTQ
    col_spec = QuantSpec(spec.bits, spec.symmetric)  # one column [N, 1] against per-row parameters
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w_blk = w[:, b0:b1].clone()
        err = torch.zeros_like(w_blk)
        u_blk = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if group is not None and col % group == 0:  # parameters from the group's already-updated columns
                qp = find_qparams(w_blk[:, i : i + group], QuantSpec(spec.bits, spec.symmetric))
                scales.append(qp.scale)
                zeros.append(qp.zero)
            x = w_blk[:, i : i + 1]
            c = quantize(x, qp, col_spec)
            q = (c.double() - (qp.zero if qp.zero is not None else 0)) * qp.scale
            codes[:, col] = c[:, 0].to(torch.int16)
            q_all[:, col] = q[:, 0]
            e = (x - q) / u_blk[i, i]  # [N, 1]
            w_blk[:, i:] -= e @ u_blk[i : i + 1, i:]
            err[:, i] = e[:, 0]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    if group is not None:
        scale = torch.cat(scales, dim=1).float()  # [N, G]
        zero = None if spec.symmetric else torch.cat(zeros, dim=1).float()
        qparams = QParams(scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1))
    else:
        qparams = QParams(qp.scale.float(), None if qp.zero is None else qp.zero.float())
    dequantized = q_all.float()
    if perm is not None:
        dequantized = torch.empty_like(dequantized).index_copy_(1, perm, dequantized)
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
        result = gptq_quantize(linear.weight.float(), inputs.hessian, dataclasses.replace(cfg, act_order=act_order))
        return build_module(result.codes, result.qparams, cfg, linear.bias, result.perm)
