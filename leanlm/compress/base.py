"""The compression method contract: a frozen *Config, a Method registered for it, and the small dataclasses
the layer loop (calibration.py) hands to methods and collects from them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

# What a method asks the loop to observe at each linear group's input (see GroupInputs).
NEEDS_HESSIAN = "hessian"
NEEDS_STATS = "stats"
# The first calibration sequences whole at each group's input, and a runner for the layer's submodules on them
# (AWQ scores its scales on the output of the attention or MLP block a group feeds).
NEEDS_SEQUENCES = "sequences"
# The calibration hidden states entering each decoder layer, and that layer as it was before the recipe's methods
# edited it (LKD distils the quantized layer against it); the loop calls fit_layer instead of apply_layer.
NEEDS_LAYER = "layer"
# Before the loop, one pass of the uncompressed model over the calibration data, calling plan_layer with every
# layer's NEEDS_STATS inputs (OWL sets each layer's sparsity from all layers' outlier ratios before pruning any).
NEEDS_PLAN = "plan"


@dataclass
class GroupInputs:
    """What the loop saw at the input of one linear group (e.g. q/k/v) of one layer, over all calibration tokens."""

    absmax: torch.Tensor  # [K] float32: max |x| per input channel
    mean_abs: torch.Tensor  # [K] float32: mean |x| per input channel
    mean_sq: torch.Tensor  # [K] float32: mean x^2 per input channel (Wanda's ||X_j||^2 / n)
    samples: torch.Tensor  # [n, K] float32: a fixed, evenly spaced subset of input rows
    num_tokens: int
    hessian: torch.Tensor | None = None  # [K, K] float32: (2 / n) X^T X, when a method needs it
    sequences: torch.Tensor | None = None  # [S', T, K] float32: the first S' calibration sequences, every row
    # run(module, x [S', T, K]) -> [S', T, N]: a submodule of this layer that reads the group's input, run on
    # whole sequences under the engine's attention context (NEEDS_SEQUENCES; None otherwise)
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


@dataclass
class LayerInputs:
    """What a NEEDS_LAYER method gets for one decoder layer."""

    hidden: torch.Tensor  # [S, T, hidden]: every calibration sequence entering the layer
    teacher: nn.Module  # a copy of the layer before any method of this recipe edited it
    # what fed each linear group, keyed by its first linear, when the method also needs NEEDS_STATS; else None
    groups: dict[str, GroupInputs] | None = None


@dataclass(frozen=True)
class LinearReport:
    """One compressed linear: what it became and how far its outputs moved on calibration inputs."""

    name: str  # full module name, e.g. model.layers.3.mlp.down_proj
    format: str  # RuntimeLinear format, or "float" for a transform-only change
    rel_error: float | None  # |X W^T - X W_q^T|^2 / |X W^T|^2 on calibration rows; None without data
    weight_sqnr_db: float  # SQNR of the stored weight against the float weight it replaced
    bytes_before: int  # float weight bytes, in the model's dtype
    bytes_after: int
    sparsity: float = 0.0  # fraction of the stored weight's entries that are exactly zero


@dataclass
class CompressionReport:
    """Everything compress() did, in layer order."""

    methods: list[str] = field(default_factory=list)
    linears: list[LinearReport] = field(default_factory=list)
    seconds: float = 0.0
    details: dict[str, dict] = field(default_factory=dict)  # method name -> what its summary() said
    # the run's steps, {"method": name, **config fields}, in recipe order: a saved Checkpoint records them
    # (`checkpoint.with_recipe(report.recipe)`)
    recipe: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method config; subclasses are frozen dataclasses validated in __post_init__."""

    name: ClassVar[str]  # the method's name in recipes, the CLI and checkpoints
    # Modules left alone: exact names or suffixes of full names ("lm_head" skips the output head).
    ignore: tuple[str, ...] = ("lm_head",)

    def ignores(self, full_name: str) -> bool:
        return any(full_name == pat or full_name.endswith("." + pat) for pat in self.ignore)


class Method(ABC):
    """Runs one config through the layer loop: `apply_layer` edits a decoder layer in place."""

    needs: ClassVar[frozenset[str]] = frozenset()  # NEEDS_* the loop must collect before apply_layer

    def __init__(self, config: MethodConfig) -> None:
        self.config = config

    @property
    def is_sequential(self) -> bool:
        """True: the loop calls apply_layer once per linear group, in the layer's order, each time with only
        that group's inputs, observed through the layer as the earlier groups left it (GPTQ's true-sequential:
        o_proj is fitted to what the quantized q/k/v produce, down_proj to the quantized gate/up)."""
        return False

    def begin(self, model: nn.Module) -> None:  # noqa: B027 (a hook most methods leave empty)
        """Called once before the layer loop, with the whole model (global magnitude pruning sets its
        threshold over every layer here); most methods need nothing."""

    def plan_layer(self, prefix: str, layer: nn.Module, inputs: dict[str, GroupInputs]) -> None:  # noqa: B027
        """For methods that need NEEDS_PLAN: called for every decoder layer, in order, before the loop compresses
        any, with what fed each of its linear groups in the uncompressed model."""

    @abstractmethod
    def apply_layer(self, layer: nn.Module, prefix: str, inputs: dict[str, GroupInputs] | None) -> list[LinearReport]:
        """Compress `layer` (full name `prefix`) in place; `inputs` maps the first linear of each of the layer's
        `linear_groups` (of the one group, for a sequential method) to what fed the group (None without
        calibration data)."""

    def fit_layer(self, layer: nn.Module, prefix: str, inputs: LayerInputs) -> list[LinearReport]:
        """For methods that need NEEDS_LAYER, called instead of apply_layer when there is calibration data; the
        others never get it, so by default it is apply_layer without group inputs."""
        return self.apply_layer(layer, prefix, None)

    def finalize(self, model: nn.Module, reports: list[LinearReport]) -> list[LinearReport]:
        """Called once after the layer loop, in recipe order, with the whole model and every linear's report (the
        recipe's other methods have compressed every layer by then): pruners pack their sparse linears here. It
        returns the reports, changed where it changed a linear; most methods leave both alone."""
        return reports

    def summary(self) -> dict:
        """What the method measured beyond its linears' reports (channel permutation: its kept-score gains)."""
        return {}

    def apply_head(self, model: nn.Module, inputs: GroupInputs | None) -> list[LinearReport]:
        """Compress the output head when the config does not ignore it; transforms leave it alone."""
        return []


_METHODS: dict[type[MethodConfig], Callable[[MethodConfig], Method]] = {}


def register_method(config_cls: type[MethodConfig]) -> Callable[[type[Method]], type[Method]]:
    def wrap(cls: type[Method]) -> type[Method]:
        _METHODS[config_cls] = cls
        return cls

    return wrap


def build_method(config: MethodConfig) -> Method:
    """The Method registered for this config's type. A MethodConfig with none is a training method (leanlm.train's
    sparsity configs share the base, so a trainer can record and validate them like these): refused with where it
    runs, since it learns its masks over training steps that the one-shot layer loop does not take."""
    cls = _METHODS.get(type(config))
    if cls is not None:
        return cls(config)
    known = ", ".join(c.__name__ for c in _METHODS)
    if isinstance(config, MethodConfig):
        name = getattr(config, "name", type(config).__name__)
        raise ValueError(
            f"{type(config).__name__} ({name!r}) is a training method: it prunes while the model trains, which "
            f"compress() does not do. Run it with `leanlm train --recipe {name}` (or leanlm.train's Trainer with it "
            f"as the sparsity); compress() runs {known}"
        )
    raise TypeError(f"{type(config).__name__} is not a compression method config; use one of {known}")
