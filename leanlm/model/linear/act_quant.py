"""DynamicActQuant: the runtime option that quantizes a weight-only int layer's activations to int8 on the fly, in
groups of 32 inputs (W4A8 / W8A8-dynamic, `--act-quant int8`), so its products run as int8 dot products on VNNI.

It is a way of running the layer, not part of its checkpoint: the codes and scales stay as saved. It is an engine's
option, so it never lives on the layer: the engine resolves EngineConfig.act_quant once (`resolve_activation_quant`)
and runs each step inside `activation_quant(mode)`, which the layers read; two engines can share one model.
"""

from __future__ import annotations

import contextlib
import threading
from abc import abstractmethod
from collections.abc import Iterator

import torch
from torch import nn

from leanlm.config.engine import ACT_QUANT_MODES
from leanlm.kernels import cpu_a8, cpu_qgemv_avx2, isa
from leanlm.kernels.native_linear import NativeLinear, describe
from leanlm.model.packed_cache import PackedCache

_state = threading.local()


@contextlib.contextmanager
def activation_quant(mode: str) -> Iterator[None]:
    """Run what is inside with `mode` activations ("int8" or "none") in every weight-only int layer that can take
    them (per thread; nestable: the mode before comes back after)."""
    if mode not in ("int8", "none"):
        raise ValueError(f"activation_quant takes 'int8' or 'none' (resolve 'auto' first), not {mode!r}")
    previous = current_activation_quant()
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = previous


def current_activation_quant() -> str:
    """The mode of the step running on this thread; "none" outside `activation_quant`."""
    return getattr(_state, "mode", "none")


class DynamicActQuant:
    """Mixin for a RuntimeLinear whose int weights the gemm_a8 kernel reads: int8 activations inside
    `activation_quant("int8")` where the layer can take them, else the layer's own 16-bit-activation paths."""

    def act_int8(self, dtype: torch.dtype) -> bool:
        """Whether this call runs int8 activations, for activations (or a native loop) of `dtype`."""
        return current_activation_quant() == "int8" and self.supports_act_quant(dtype)

    def _init_act_quant(self) -> None:
        self.act_packed = PackedCache()  # the codes in gemm_a8's panels, made on first use

    @property
    def act_group_size(self) -> int | None:
        """The weight group size gemm_a8 sees (None: one scale per channel)."""
        return self.group_size

    def supports_act_quant(self, dtype: torch.dtype | None = None) -> bool:
        """Whole activation groups of 32 and weight groups made of them; act-order int4 too (x is gathered first).
        `dtype`: the model's float dtype, for formats whose only int8-activation kernel takes one (Q6_K's)."""
        return cpu_a8.shape_ok(self.in_features, self.act_group_size)

    @abstractmethod
    def _pack_a8(self, *tensors: torch.Tensor) -> cpu_a8.PackedA8:
        """The layer's codes and scales (and bias) packed for gemm_a8."""

    @abstractmethod
    def _a8_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """What _pack_a8 reads, in its order (the cache key: a change to any of them repacks)."""

    def a8_weight(self) -> cpu_a8.PackedA8 | None:
        """The packed codes when the kernel can run them (CPU weights, a VNNI CPU), else None."""
        tensors = self._a8_tensors()
        shape_ok = cpu_a8.shape_ok(self.in_features, self.act_group_size)  # not so for Q6_K's groups of 16
        if not (shape_ok and tensors[0].is_cpu and cpu_a8.is_available()):
            return None
        return self.act_packed.get(tensors, self._pack_a8)

    def stored_order(self, x: torch.Tensor) -> torch.Tensor:
        """x in the order the codes are stored (act-order layers gather it; the others keep it)."""
        return x

    def act_quant_avx2(self, xs: torch.Tensor) -> torch.Tensor | None:
        """y from the AVX2 level's W4A8 GEMV for float32 rows in stored order, where the format has one and it takes
        them; else None."""
        return None

    def _act_quant_forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = self.stored_order(x)
        packed = self.a8_weight()
        if cpu_a8.rows_fit(xs, packed):
            return cpu_a8.gemm(xs, packed)
        if (y := self.act_quant_avx2(xs)) is not None:
            return y
        return cpu_a8.reference(xs, self.a8_stored_weight().to(x.device), self.bias)

    def a8_stored_weight(self) -> torch.Tensor:
        """The float32 weight [N, K] in the stored column order (the reference path's; formats with a native
        dequantization override it)."""
        w = self.dequantized_weight()  # [N, K] in input order
        perm = getattr(self, "perm", None)
        return w if perm is None else w[:, perm]  # stored column j is input column perm[j]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_int8(x.dtype):
            return self._act_quant_forward(x)
        return super().forward(x)

    def act_quant_native(self, packed: bool) -> NativeLinear | None:
        """The decode loop's view of this layer with int8 activations: gemm_a8 at every row count."""
        call = cpu_a8.native_call(self.a8_weight(), self.out_features, self.in_features)
        return describe(self.out_features, self.in_features, call, call, packed, getattr(self, "perm", None))


def _auto(reference: torch.Tensor) -> bool:
    """auto's choice, from one of the model's float tensors: int8 activations where our kernels run them (a bf16
    model on a CPU with AVX512-VNNI: gemm_a8; a float32 model at the AVX2 level, where float32 is the fast dtype:
    the W4A8 / W8A8 GEMVs, as llama.cpp computes; LLM(dtype="float32") asks for exact products and gets "none");
    elsewhere the float reference would cost time for nothing. Decided for the whole model,
    so offloaded layers (whose tensors are elsewhere until they run) choose as the rest."""
    if reference.device.type != "cpu":
        return False
    if reference.dtype is torch.bfloat16:
        return cpu_a8.is_available()
    # float32 is the fast dtype only at the AVX2 level (above it, bf16 is): there it is what dtype="auto" chose
    at_avx2 = isa.active_level() == "avx2"
    return reference.dtype is torch.float32 and at_avx2 and cpu_qgemv_avx2.act_int8_is_available()


def resolve_activation_quant(model: nn.Module, mode: str) -> tuple[str, int]:
    """EngineConfig.act_quant for `model`: "int8", "none", or "auto" (int8 where the VNNI kernel runs the layers, see
    _auto) -> (the mode its steps run with, "int8" or "none"; how many layers then quantize their activations: a
    layer whose K or groups gemm_a8 cannot take keeps 16-bit ones)."""
    if mode not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be one of {ACT_QUANT_MODES}, not {mode!r}")
    reference = next((p for p in model.parameters() if p.is_floating_point()), torch.empty(0))
    resolved = "int8" if mode == "int8" or (mode == "auto" and _auto(reference)) else "none"
    if resolved == "none":
        return resolved, 0
    layers = [m for m in model.modules() if isinstance(m, DynamicActQuant)]
    return resolved, sum(1 for m in layers if m.supports_act_quant(reference.dtype))
