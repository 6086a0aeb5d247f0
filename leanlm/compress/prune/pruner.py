"""Pruner: the Method shape shared by every pruning method (magnitude, Wanda, SparseGPT). Each not-ignored
float linear of a layer keeps its module and gets zeros where the method prunes; the mask stays on the
module as `sparsity_mask` (not a tensor of its state dict) so a quantizer later in the recipe keeps those
weights at zero (GPTQ spreads no error into them; RTN's grids hold 0 exactly). Linears still float at the end
of the recipe become Sparse24Linear when 2:4, BitmaskSparseLinear when at least bitmask.MIN_SPARSITY of their
weights are zero (`pack_semi_structured`), unless the pruner says pack=False; int8 and 2-4 bit layers quantized
from 2:4 weights become their 2:4 formats (`pack_quantized_24`).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import abstractmethod

import torch
from torch import nn

from leanlm.compress.base import NEEDS_PLAN, GroupInputs, LinearReport, Method, MethodConfig
from leanlm.compress.prune.owl import LayerPlan
from leanlm.compress.prune.sparsity import satisfies_nm
from leanlm.compress.quantize.int_scheme import linear_report
from leanlm.compress.quantize.linear_quantizer import group_linears
from leanlm.compress.transform.smoothing import set_tensor
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear, is_sparse_enough
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.linear.sparse24_quant import to_sparse24_quantized
from leanlm.model.sparsity_mask import MASK_ATTR, pruned_mask

logger = logging.getLogger(__name__)


def pack_pruned(model: nn.Module, scheme, reports: list[LinearReport]) -> list[LinearReport]:
    """The packing rule every sparsity `scheme` (a SparsityScheme: a pruner's config, or a training-time sparsity
    config after its run) ends with: 2:4 and unstructured patterns pack where they have a kernel, after whatever
    quantizer followed (2:4 int8 / int4 layers become their 2:4 formats); other N:M patterns stay float."""
    if not (scheme.pack and scheme.pattern in ("2:4", None)):
        return reports
    return pack_quantized_24(model, pack_semi_structured(model, reports))


class Pruner(Method):
    """A config with an OWL profile (owl.LayerProfile) is pruned layer by layer at the sparsity its plan gives
    the layer: the methods read their target from the `scheme` they are handed, never from self.config."""

    def __init__(self, config: MethodConfig) -> None:
        super().__init__(config)
        self.plan = LayerPlan(config) if config.profile == "owl" else None
        if self.plan is not None:
            self.needs = type(self).needs | {NEEDS_PLAN}

    def finalize(self, model: nn.Module, reports: list[LinearReport]) -> list[LinearReport]:
        """2:4 and unstructured prunes pack (the latter only where sparse enough: sparse_format), after whatever
        quantizer followed in the recipe (2:4 int8 / int4 layers become their 2:4 formats); other N:M patterns have
        no kernel and stay float. Packing twice changes nothing, so two pruners in one recipe are fine."""
        return pack_pruned(model, self.config, reports)

    def plan_layer(self, prefix, layer, inputs):
        if self.plan is not None:
            self.plan.observe(prefix, layer, inputs)

    def summary(self) -> dict:
        return self.plan.summary() if self.plan is not None else {}

    @abstractmethod
    def prune_linear(self, name: str, linear: nn.Linear, inputs: GroupInputs | None, scheme) -> torch.Tensor:
        """The new float32 weight [N, K] of `linear` (full name `name`), zeros where pruned to `scheme` (the
        config, or its copy with this layer's sparsity); a method may also update the kept weights (SparseGPT)."""

    def _prune(self, parent: nn.Module, name: str, full: str, inputs: GroupInputs | None, scheme) -> list[LinearReport]:
        linear = parent.get_submodule(name)
        if self.config.ignores(full) or not isinstance(linear, nn.Linear):
            return []
        self.config.check_shape(linear.in_features)
        before = linear.weight.detach().float().clone()
        weight = self.prune_linear(full, linear, inputs, scheme)
        earlier = pruned_mask(linear)
        if earlier is not None:  # a second pruning step keeps what the first one removed removed
            weight = weight.masked_fill(earlier, 0.0)
        set_tensor(linear, "weight", weight)  # never in place: the weight may be the checkpoint's own tensor
        setattr(linear, MASK_ATTR, linear.weight == 0)
        nbytes = linear.weight.numel() * linear.weight.element_size()
        report = linear_report(full, before, linear, inputs, nbytes)
        return [dataclasses.replace(report, format="float")]

    def apply_layer(self, layer, prefix, inputs):
        scheme = self.config if self.plan is None else self.plan.scheme(prefix)
        reports = []
        for name, full, _, fed in group_linears(layer, prefix, inputs):
            reports += self._prune(layer, name, full, fed, scheme)
        return reports

    def apply_head(self, model, inputs):
        return self._prune(model, "lm_head", "lm_head", inputs, self.config)


def sparse_format(weight: torch.Tensor) -> type[RuntimeLinear] | None:
    """The runtime module a pruned weight [N, K] packs into: Sparse24Linear when it is 2:4, BitmaskSparseLinear
    when at least bitmask.MIN_SPARSITY of it is zero (where its kernel beats the dense one), else None (it stays
    float).
    K must be a multiple of 8 (one mask byte per 8 columns)."""
    if weight.shape[1] % 8:
        return None
    if satisfies_nm(weight, 2, 4):
        return Sparse24Linear
    if is_sparse_enough(int((weight == 0).sum()), *weight.shape):
        return BitmaskSparseLinear
    return None


def pack_semi_structured(model: nn.Module, reports: list[LinearReport]) -> list[LinearReport]:
    """Swap every pruned float linear for its sparse runtime module (sparse_format: 2:4 values + bitmask, or the
    nonzeros + a bit per weight), in the weight's dtype (exact); the reports of those linears say so."""
    packed = {}
    for name, module in list(model.named_modules()):
        if pruned_mask(module) is None or not isinstance(module, nn.Linear):
            continue
        cls = sparse_format(module.weight.detach())
        if cls is None:
            continue
        layer = cls.from_dense(module.weight, module.bias, module.weight.dtype)
        model.set_submodule(name, layer)
        bias_bytes = 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
        packed[name] = (cls.format, layer.weight_bytes() + bias_bytes)
    return [
        dataclasses.replace(r, format=packed[r.name][0], bytes_after=packed[r.name][1]) if r.name in packed else r
        for r in reports
    ]


def pack_quantized_24(model: nn.Module, reports: list[LinearReport]) -> list[LinearReport]:
    """Swap every int8 or 2-4 bit weight-only layer whose weight is 2:4 (pruned, then quantized) for its 2:4
    format, which stores only the kept codes (exact). Layers the formats cannot take (act-order permutations,
    group sizes or widths not a multiple of 64) stay dense and their reports say so by their format."""
    packed = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (Int8WeightOnlyLinear, IntGroupWeightOnlyLinear)):
            continue
        if not satisfies_nm(module.dequantized_weight(), 2, 4):
            continue
        try:
            layer = to_sparse24_quantized(module)
        except ValueError as exc:
            logger.info("%s stays %s: %s", name, module.format, exc)
            continue
        model.set_submodule(name, layer)
        packed[name] = (layer.format, layer.weight_bytes() + (0 if layer.bias is None else layer.bias.nbytes))
    return [
        dataclasses.replace(r, format=packed[r.name][0], bytes_after=packed[r.name][1]) if r.name in packed else r
        for r in reports
    ]
