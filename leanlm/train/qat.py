"""Quantization-aware training: a model quantized by a recipe step (RTN's int8 or 2-4 bit layers) trains with every
quantized linear replaced by a FakeQuantLinear (weights, scales and offsets learnable; the forward rounds with a
straight-through estimator, LSQ-style for the scales), and gets its runtime layers back, with the trained codes,
after training. The checkpoint then loads like any other quantized one."""

from __future__ import annotations

from torch import nn

from leanlm.model.quantized import fake_quant


def attach_fake_quant(model: nn.Module) -> int:
    """Replace every int8 / 2-4 bit weight-only linear by its trainable stand-in; how many were replaced."""
    count = len(fake_quant.attach_fake_quant(model))
    if count == 0:
        raise ValueError("QAT needs quantized linears: quantize first (RTN int8, or 2-4 bits group-wise)")
    return count


def detach_fake_quant(model: nn.Module) -> int:
    """Put back the runtime layers, with the trained codes, scales and offsets."""
    return fake_quant.detach_fake_quant(model)
