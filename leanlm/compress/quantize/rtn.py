"""Round-to-nearest quantization (weight-only W8A16 / W4A16 / W3A16 with groups, W8A8 per-token, and
ZeroQuant's group-wise weights with token-wise activations, Yao et al. 2022): no data needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.compress.base import MethodConfig, register_method
from leanlm.compress.quantize.int_scheme import IntScheme, build_module
from leanlm.compress.quantize.linear_quantizer import LinearQuantizer
from leanlm.model.quantized.numerics import compute_qparams, quantize


@dataclass(frozen=True)
class RTNConfig(MethodConfig, IntScheme):
    """Round each weight to the nearest point of its group's min/max (or absmax) grid."""

    name = "rtn"


def quantize_rtn(weight: torch.Tensor, bias: torch.Tensor | None, scheme: IntScheme) -> nn.Module:
    """The runtime module for round-to-nearest of weight [N, K] under `scheme`."""
    spec = scheme.spec(weight.shape[1])
    qp = compute_qparams(weight.float(), spec)
    return build_module(quantize(weight, qp, spec), qp, scheme, bias)


@register_method(RTNConfig)
class RTN(LinearQuantizer):
    def quantize_linear(self, linear, inputs):
        return quantize_rtn(linear.weight, linear.bias, self.config)
