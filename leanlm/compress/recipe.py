"""compress(model, recipe, calibration): run method configs, in order, through the single layer loop.

Recipes compose: transforms (SmoothQuantConfig, AWQConfig) edit float weights and norms, quantizers
(RTNConfig, GPTQConfig, LLMInt8Config, FP8Config) turn linears into runtime modules, e.g.
`[SmoothQuantConfig(alpha=0.5), RTNConfig(bits=8, act_bits=8)]` or `[AWQConfig(bits=4), RTNConfig(bits=4)]`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn

from leanlm.compress.base import CompressionReport, MethodConfig, build_method
from leanlm.compress.calibration import run_layers


def compress(
    model: nn.Module,
    recipe: MethodConfig | Sequence[MethodConfig],
    calibration: torch.Tensor | None = None,
    batch: int = 8,
    progress: bool = True,
) -> CompressionReport:
    """Compress `model` in place; the report's `recipe` holds the steps a saved Checkpoint records.
    calibration: token ids [num_samples, seq_len] (see calibration_samples), needed by GPTQ, AWQ, SmoothQuant and
    LLM.int8(); optional for RTN and FP8 (then it only feeds the error report)."""
    from leanlm.formats.checkpoint import require_network

    require_network(model, "compress")
    recipe = [recipe] if isinstance(recipe, MethodConfig) else list(recipe)
    if not recipe:
        raise ValueError("the recipe is empty; pass at least one method config, e.g. RTNConfig(bits=8)")
    methods = [build_method(cfg) for cfg in recipe]  # TypeError for anything that is not a method config
    if calibration is not None and (calibration.dim() != 2 or calibration.dtype not in (torch.int32, torch.int64)):
        raise ValueError(
            f"calibration must be token ids [num_samples, seq_len], got {calibration.dtype} {tuple(calibration.shape)}"
        )
    start = time.perf_counter()
    reports = run_layers(model, methods, calibration, batch=batch, progress=progress)
    for method in methods:  # after every layer went through every method: pruners pack here
        reports = method.finalize(model, reports)
    details = {cfg.name: summary for cfg, m in zip(recipe, methods, strict=True) if (summary := m.summary())}
    steps = [{"method": cfg.name, **_as_json(cfg)} for cfg in recipe]
    return CompressionReport([cfg.name for cfg in recipe], reports, time.perf_counter() - start, details, steps)


def _as_json(cfg: MethodConfig) -> dict:
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v) for f in dataclasses.fields(cfg)}
