"""The optimal-brain-surgeon core shared by GPTQ and SparseGPT (Frantar & Alistarh 2022/2023): dampen the
layer Hessian H = 2 X^T X / n, handle dead inputs, and factor H^-1 as the upper Cholesky factor that the
column-by-column error updates read."""

from __future__ import annotations

from collections.abc import Callable

import torch


def prepare_hessian(
    hessian: torch.Tensor, weight: torch.Tensor, damp_percent: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(H dampened, W with dead columns zeroed): inputs that were always zero get H_ii = 1 and no weight,
    then `damp_percent` of the mean diagonal is added to the diagonal (numerical stability). A Hessian with no
    sample at all (an expert no calibration token was routed to) says nothing about any input: H = I, and the
    method falls back to plain rounding or magnitude instead of zeroing the whole layer."""
    h = hessian.double().clone()
    w = weight.double().clone()
    if not torch.any(torch.diag(h)):
        return torch.eye(h.shape[0], dtype=h.dtype, device=h.device), w
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    damp = damp_percent * torch.mean(torch.diag(h))
    h.diagonal().add_(damp)
    return h, w


def inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U); row i of U carries column i's OBS update weights."""
    for attempt in range(5):
        try:
            lower = torch.linalg.cholesky(h)
            break
        except torch.linalg.LinAlgError:  # not positive definite: dampen more
            h = h.clone()
            h.diagonal().add_(0.01 * torch.mean(torch.diag(h)) * 10**attempt)
    else:
        raise ValueError(
            "the Hessian is not positive definite even after extra dampening; use more "
            "calibration data or a larger damp_percent"
        )
    h_inv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(h_inv, upper=True)


# select(i, w_blk, u_blk, pruned_blk): may mark entries of pruned_blk (a view of the block's mask) before
# column i of the block is fixed, from the block's current weights and its slice of U (SparseGPT's mask choice).
Select = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
# round_column(col, x, w_blk, pruned_blk, i): the stored values of column `col` (block column i) given x [N, 1],
# the column with its pruned entries already zero (GPTQ's grid; pruned entries must stay 0).
RoundColumn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def obs_sweep(
    w: torch.Tensor,
    u: torch.Tensor,
    block: int,
    pruned: torch.Tensor,
    select: Select | None = None,
    round_column: RoundColumn | None = None,
) -> torch.Tensor:
    """Fix the columns of w [N, K] (float64, updated in place) left to right: column i's pruned entries become 0
    and the rest go through round_column (identity without one); the change, divided by U_ii, is spread over
    the not-yet-fixed columns through row i of U [K, K] (H^-1 = U^T U), with lazy updates per `block` columns.
    pruned [N, K] bool is read (and filled by `select`). Returns the fixed weights [N, K]. GPTQ is this sweep
    with a rounding step, SparseGPT with a select step, joint prune + quantize with both."""
    n, k = w.shape
    out = torch.empty_like(w)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w_blk = w[:, b0:b1].clone()
        p_blk = pruned[:, b0:b1]
        err = torch.zeros_like(w_blk)
        u_blk = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            if select is not None:
                select(i, w_blk, u_blk, p_blk)
            x = w_blk[:, i : i + 1]
            q = x.masked_fill(p_blk[:, i : i + 1], 0.0)
            if round_column is not None:
                q = round_column(b0 + i, q, w_blk, p_blk, i)
            out[:, b0 + i] = q[:, 0]
            e = (x - q) / u_blk[i, i]  # [N, 1]
            w_blk[:, i:] -= e @ u_blk[i : i + 1, i:]
            err[:, i] = e[:, 0]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return out
