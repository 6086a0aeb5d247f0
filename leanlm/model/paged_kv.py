"""PagedKVCache: the K/V tensors of a model's layers, in blocks, with an 8-bit cache's scales.

Whoever runs the model owns one (the engine's ModelRunner; a separate draft model's proposer; compression's
LayerRunner) and hands it to every forward through the ForwardContext: the model holds no cache, so two
engines over one model's weights never write into each other's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from leanlm.model.kv_quant import SCALE_DTYPE, is_quantized


class LayerKV(NamedTuple):
    """One layer's slice of the cache, as attention reads and writes it."""

    k_cache: torch.Tensor  # [N, Hkv, bs, D]: one head's block is contiguous
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None  # [N, Hkv, bs] float32 for an 8-bit cache, else None
    v_scales: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """K/V of layers first_layer .. first_layer + L - 1. Identity matters (eq=False): native decode state binds
    to one cache object and rebinds when handed another."""

    kv: torch.Tensor  # [L, 2, N, Hkv, bs, D]
    scales: torch.Tensor | None = None  # [L, 2, N, Hkv, bs] float32, exactly when kv is 8-bit (int8/fp8)
    first_layer: int = 0  # the model layer index of kv[0]
    _layers: tuple[LayerKV, ...] = field(init=False, repr=False)  # views, built once: forwards index them per layer

    def __post_init__(self) -> None:
        if self.kv.dim() != 6 or self.kv.shape[1] != 2:
            raise ValueError(f"a paged KV cache is [L, 2, N, Hkv, block_size, D], got {tuple(self.kv.shape)}")
        if is_quantized(self.kv.dtype) != (self.scales is not None):
            raise ValueError(f"a {self.kv.dtype} KV cache needs scales exactly when it is 8-bit (int8/fp8)")
        if self.scales is not None and (self.scales.shape != self.kv.shape[:-1] or self.scales.dtype != SCALE_DTYPE):
            raise ValueError(
                f"KV scales must be {SCALE_DTYPE} {tuple(self.kv.shape[:-1])}, got "
                f"{self.scales.dtype} {tuple(self.scales.shape)}"
            )
        layers = tuple(
            LayerKV(self.kv[i, 0], self.kv[i, 1], *((None, None) if self.scales is None else self.scales[i]))
            for i in range(self.kv.shape[0])
        )
        object.__setattr__(self, "_layers", layers)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        first_layer: int = 0,
    ) -> PagedKVCache:
        """Zeroed values (unit scales for an 8-bit dtype)."""
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        kv = torch.zeros(shape, dtype=dtype, device=device)
        scales = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device) if is_quantized(dtype) else None
        return cls(kv, scales, first_layer)

    def layer(self, layer_idx: int) -> LayerKV:
        i = layer_idx - self.first_layer
        if not 0 <= i < len(self._layers):
            raise IndexError(
                f"this KV cache holds layers {self.first_layer}..{self.first_layer + len(self._layers) - 1}, "
                f"not layer {layer_idx}; give the forward a cache covering every layer it runs"
            )
        return self._layers[i]

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[3]

    @property
    def block_size(self) -> int:
        return self.kv.shape[4]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[5]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        tensors = (self.kv,) if self.scales is None else (self.kv, self.scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block src[i] into block dst[i] in every layer, values and scales (copy-on-write)."""
        self.kv[:, :, dst] = self.kv[:, :, src]  # [L, 2, n, Hkv, bs, D]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]  # [L, 2, n, Hkv, bs]
