"""LinearQuantizer: the Method shape shared by every quantizer (RTN, GPTQ, LLM.int8(), FP8): turn each
not-ignored float linear of a layer, then the head, into a runtime module, and report the error."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator

from torch import nn

from leanlm.compress.base import GroupInputs, LinearReport, Method
from leanlm.compress.quantize.int_scheme import linear_report
from leanlm.model.linear.base import RuntimeLinear


def group_linears(
    layer: nn.Module,
    prefix: str,
    inputs: dict[str, GroupInputs] | None,
) -> Iterator[tuple[str, str, nn.Module, GroupInputs | None]]:
    """(name in layer, full name, module, what fed it) for every linear of the layer, in group order; with
    inputs, only the groups they hold (a sequential method gets one group at a time)."""
    for group in layer.linear_groups:
        if inputs is not None and group.linears[0] not in inputs:
            continue
        fed = None if inputs is None else inputs[group.linears[0]]
        for name in group.linears:
            yield name, f"{prefix}.{name}", layer.get_submodule(name), fed


class LinearQuantizer(Method):
    @abstractmethod
    def quantize_linear(self, linear: nn.Linear, inputs: GroupInputs | None) -> RuntimeLinear:
        """The runtime module replacing `linear`, given what fed it on calibration data (None without)."""

    def _replace(self, parent: nn.Module, name: str, full: str, inputs: GroupInputs | None) -> list[LinearReport]:
        linear = parent.get_submodule(name)
        if self.config.ignores(full) or not isinstance(linear, nn.Linear):
            return []
        module = self.quantize_linear(linear, inputs)
        before = linear.weight.numel() * linear.weight.element_size()
        report = linear_report(full, linear.weight, module, inputs, before)
        parent.set_submodule(name, module)
        return [report]

    def apply_layer(self, layer, prefix, inputs):
        reports = []
        for name, full, _, fed in group_linears(layer, prefix, inputs):
            reports += self._replace(layer, name, full, fed)
        return reports

    def apply_head(self, model, inputs):
        return self._replace(model, "lm_head", "lm_head", inputs)
