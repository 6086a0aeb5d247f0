"""Checkpoint: what a saved model is, whatever its format: the network (its weights and, as `model.config`, its
ModelConfig), its tokenizer and the recipe that made it. Loaders return one, every format's writer takes one."""

from __future__ import annotations

import dataclasses
import os
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
        if isinstance(self.model, Checkpoint):
            raise TypeError("Checkpoint(model, ...) takes the network; this is already a Checkpoint: use it as it is")
        if not is_network(self.model):
            raise TypeError(
                f"a Checkpoint holds a leanlm model with a ModelConfig (load_model(...) or "
                f"load_checkpoint(...).model), got {type(self.model).__name__}"
            )
        if self.tokenizer is not None and not isinstance(self.tokenizer, Tokenizer):
            raise TypeError(
                f"a Checkpoint's tokenizer is a leanlm Tokenizer (load_checkpoint(...).tokenizer, "
                f"leanlm.formats.load_tokenizer(path)) or None, got {type(self.tokenizer).__name__}"
            )
        if not isinstance(self.recipe, tuple) or not all(isinstance(s, dict) and "method" in s for s in self.recipe):
            raise TypeError("a Checkpoint's recipe is a tuple of {'method': ..., ...} dicts; pass tuple(steps)")

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def with_recipe(self, steps: Iterable[dict[str, Any]]) -> Checkpoint:
        """This checkpoint with `steps` (a CompressionReport's `recipe`, a trainer's step) after its recipe."""
        return dataclasses.replace(self, recipe=self.recipe + tuple(steps))


def is_network(value: object) -> bool:
    """A leanlm network: a module that carries its ModelConfig (what load_model returns)."""
    return isinstance(value, nn.Module) and isinstance(getattr(value, "config", None), ModelConfig)


def require_checkpoint(value: object, call: str) -> Checkpoint:
    """`value` if it is a Checkpoint, else a TypeError naming the call that makes one of what was passed (a bare
    network has no `.model` of its own kind: read as a Checkpoint it would save a broken directory)."""
    if isinstance(value, Checkpoint):
        return value
    if is_network(value):
        hint = (
            f"wrap the model: {call}(Checkpoint(model, tokenizer), dir), or load it with load_checkpoint(...) "
            f"(which returns model, tokenizer and recipe together) instead of load_model(...)"
        )
    elif type(value).__module__ == "leanlm.llm":
        hint = "an LLM is for generation; load the model with load_checkpoint(name_or_path) and pass that"
    else:
        hint = "load one with load_checkpoint(name_or_path), or build Checkpoint(model, tokenizer)"
    raise TypeError(f"{call} takes a Checkpoint, got {type(value).__name__}; {hint}")


def require_network(value: object, call: str) -> nn.Module:
    """`value` if it is a leanlm network, else a TypeError naming the call that gives one."""
    if is_network(value):
        return value
    if isinstance(value, Checkpoint):
        hint = f"pass its network: {call}(checkpoint.model, ...)"
    elif type(value).__module__ == "leanlm.llm":
        hint = "an LLM is for generation; load the network with load_model(name_or_path) (or load_checkpoint)"
    else:
        hint = "load one with load_model(name_or_path) or load_checkpoint(name_or_path).model"
    raise TypeError(f"{call} takes a leanlm model (a network with a ModelConfig), got {type(value).__name__}; {hint}")


def require_model_path(value: object, call: str) -> str | os.PathLike:
    """`value` if it names a model (a bundled name, a GGUF file or a directory: str or path), else a TypeError
    saying what to pass: a model already in memory is saved first, then named."""
    if isinstance(value, (str, os.PathLike)):
        return value
    if isinstance(value, Checkpoint) or is_network(value):
        wrap = "checkpoint" if isinstance(value, Checkpoint) else "Checkpoint(model, tokenizer)"
        hint = f"this model is already loaded: save it with save_checkpoint({wrap}, dir), then call {call}(dir)"
    else:
        hint = "pass a bundled model name (leanlm models), a GGUF file or a model directory"
    raise TypeError(f"{call} takes a model name or path, got {type(value).__name__}; {hint}")
