"""The training-time methods by name (`leanlm train --recipe NAME`) and the SparseTraining each config runs."""

from __future__ import annotations

from collections.abc import Callable

from leanlm.compress.base import MethodConfig
from leanlm.train.act_sparse import ActSparseTraining, TEALTrainConfig
from leanlm.train.sparse import (
    SRSTE,
    GMPConfig,
    GradualMagnitude,
    MaskedConfig,
    MaskedTraining,
    RewindConfig,
    Rewinding,
    SparseTraining,
    SRSTEConfig,
    TopKAST,
    TopKASTConfig,
)

TRAINING_CONFIGS = {
    cfg.name: cfg for cfg in (MaskedConfig, GMPConfig, RewindConfig, SRSTEConfig, TopKASTConfig, TEALTrainConfig)
}

_METHODS: dict[type, Callable[[MethodConfig], SparseTraining]] = {
    MaskedConfig: MaskedTraining,
    GMPConfig: GradualMagnitude,
    RewindConfig: Rewinding,
    SRSTEConfig: SRSTE,
    TopKASTConfig: TopKAST,
    TEALTrainConfig: ActSparseTraining,
}


def build_sparse_training(config: MethodConfig) -> SparseTraining:
    try:
        return _METHODS[type(config)](config)
    except KeyError:
        raise TypeError(f"{type(config).__name__} is not a training-time sparsity config") from None
