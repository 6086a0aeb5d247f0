"""Training with activation sparsity (`leanlm train --recipe teal`): the model fine-tunes with TEAL's
sparsification in its forward, so its weights learn to do without the small inputs decode will skip; the
weights stay dense. At the end `compress` calibrates the fixed thresholds decode uses on the trained weights
(leanlm.compress.activation.act_sparsity), as `leanlm prune --method teal` does for an untrained model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.compress.base import MethodConfig
from leanlm.compress.prune.sparsity import SparsityScheme
from leanlm.train.sparse import SparseTraining, target_linears


@dataclass(frozen=True)
class TEALTrainConfig(MethodConfig, SparsityScheme):
    """Fine-tune with TEAL's activation sparsity in the forward: every target linear's inputs at or below the
    `sparsity` quantile of |x| (taken per batch) are zero, so the weights learn to do without them; the
    weights stay dense. After the run, `runtime_config()` calibrates fixed thresholds through `compress`, as
    `leanlm prune --method teal` does for an untrained model."""

    name = "teal"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nm is not None:
            raise ValueError("teal zeroes a fraction of each linear's inputs: pass sparsity, not an N:M pattern")

    @property
    def sparsity_label(self) -> str:
        return f"{self.sparsity:.0%} of the inputs"

    def runtime_config(self):
        from leanlm.compress.activation.act_sparsity import ActivationSparsityConfig

        return ActivationSparsityConfig(sparsity=self.sparsity, ignore=self.ignore)


# Inputs whose |x| sets a batch's threshold: a strided sample of at most this many (kthvalue over a whole
# [8 x 512, 1536] input would cost as much as the product it guards)
THRESHOLD_SAMPLE = 65536


def zero_small_inputs(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """x with its entries at or below the `sparsity` quantile of |x| set to zero (the quantile of a strided
    sample; the stride is odd, so the sample is not confined to even channels). Zeroed entries pass no
    gradient back, as they contribute nothing at decode."""
    flat = x.detach().reshape(-1)
    sample = flat[:: flat.numel() // THRESHOLD_SAMPLE | 1].float().abs()
    count = int(sparsity * sample.numel())
    if count == 0:
        return x
    threshold = sample.kthvalue(count).values
    return x.masked_fill(x.detach().abs() <= threshold, 0)


class ActSparseTraining(SparseTraining):
    """TEAL in the forward: a pre-hook on every target linear zeroes its small inputs (no masks on weights, so
    nothing to save in the state: the thresholds come from each batch)."""

    def attach(self, model):
        self.linears = target_linears(model, self.config)
        if not self.linears:
            raise ValueError(f"{self.config.name}: no linear to sparsify (check `ignore`)")
        sparsity = self.config.sparsity
        self.hooks = [
            m.register_forward_pre_hook(lambda _, args: (zero_small_inputs(args[0], sparsity), *args[1:]))
            for m in self.linears.values()
        ]

    def finish(self):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        return {"input sparsity": self.config.sparsity}
