"""Where and in what dtype a model runs: the default device, and what dtype "auto" means on it."""

from __future__ import annotations

import logging

import torch

from leanlm.config import ModelConfig, parse_dtype
from leanlm.model.dtype_probe import choose_cpu_dtype

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, or the default one."""
    return torch.device(device) if device is not None else default_device()


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: ModelConfig) -> torch.dtype:
    """'auto': bfloat16 on CUDA; on a CPU, what the engine's linear layer runs faster here (a probe on the
    model's MLP shape, cached per machine: leanlm.model.dtype_probe), logged with its reason."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type != "cpu":
        return torch.bfloat16
    choice = choose_cpu_dtype(config.hidden_size, config.intermediate_size)
    logger.info("dtype auto -> %s (%s)", str(choice.dtype).removeprefix("torch."), choice.reason)
    return choice.dtype
