"""Checkpoint: what a saved model is, whatever its format: the network (its weights and, as `model.config`, its
ModelConfig), its tokenizer and the recipe that made it. Loaders return one, every format's writer takes one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from leanlm.config import ModelConfig
from leanlm.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class Checkpoint:
    """A model with what travels with it. Derive a new one (`with_recipe`, dataclasses.replace); never set
    attributes on the model to carry these."""

    model: nn.Module  # a LlamaForCausalLM: the weights, float or compressed runtime layers, and `config`
    tokenizer: Tokenizer | None  # written next to the weights; None writes none (a bare network)
    # each compression or training step that made the model, oldest first, as JSON objects {"method": ..., ...};
    # the native format stores it (quantization_config.json "recipe"), GPTQ / compressed-tensors have no place
    recipe: tuple[dict[str, Any], ...] = ()
    source: Path | None = None  # the file or directory it was read from; None for a model made in memory

    def __post_init__(self) -> None:
        if not isinstance(getattr(self.model, "config", None), ModelConfig):
            raise TypeError(f"a Checkpoint holds a leanlm model with a ModelConfig, got {type(self.model).__name__}")
        if not isinstance(self.recipe, tuple) or not all(isinstance(s, dict) and "method" in s for s in self.recipe):
            raise TypeError("a Checkpoint's recipe is a tuple of {'method': ..., ...} dicts; pass tuple(steps)")

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def with_recipe(self, steps: Iterable[dict[str, Any]]) -> Checkpoint:
        """This checkpoint with `steps` (a CompressionReport's `recipe`, a trainer's step) after its recipe."""
        return dataclasses.replace(self, recipe=self.recipe + tuple(steps))
