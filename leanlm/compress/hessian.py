"""The optimal-brain-surgeon core shared by GPTQ and SparseGPT (Frantar & Alistarh 2022/2023): dampen the
layer Hessian H = 2 X^T X / n, handle dead inputs, and factor H^-1 as the upper Cholesky factor that the
column-by-column error updates read."""

from __future__ import annotations

import torch


def prepare_hessian(
    hessian: torch.Tensor, weight: torch.Tensor, damp_percent: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(H dampened, W with dead columns zeroed): inputs that were always zero get H_ii = 1 and no weight,
    then `damp_percent` of the mean diagonal is added to the diagonal (numerical stability)."""
    h = hessian.double().clone()
    w = weight.double().clone()
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
