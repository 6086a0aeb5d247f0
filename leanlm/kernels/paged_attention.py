"""Paged decode attention for bfloat16 KV caches, and int8 ones with per-(token, KV head) scales, on AVX512-BF16
CPUs (paged_attention_bf16.c via ctypes).

Reads K/V in place through the block tables; the torch backend's gather + SDPA stays the reference path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leanlm.kernels.build import NativeKernel

_KERNEL = NativeKernel(
    source=Path(__file__).with_name("paged_attention_bf16.c"),
    symbol="paged_decode_attention_bf16",
    argtypes=[ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int],
    restype=ctypes.c_int,
)
_KERNEL_INT8 = NativeKernel(
    source=_KERNEL.source,
    symbol="paged_decode_attention_int8kv",
    argtypes=[ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int],
    restype=ctypes.c_int,
)
MAX_GROUP = 16  # query heads per KV head the kernel supports
MAX_HEAD_DIM = 256


def is_available() -> bool:
    return _KERNEL.is_available()


def native_entries() -> tuple[int | None, int | None]:
    """Addresses of the bf16-cache and int8-cache kernels, for a native caller (the decode loop); None if unloaded."""
    return _KERNEL.address(), _KERNEL_INT8.address()


def supports_heads(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Head shapes the kernels handle: a head dim that is a multiple of 32 up to 256, at most MAX_GROUP query
    heads per KV head."""
    return (
        head_dim % 32 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


def should_use(q: torch.Tensor, k_cache: torch.Tensor, k_scales: torch.Tensor | None = None) -> bool:
    """bf16 queries on the CPU over a bf16 cache, or an int8 one with its scales, with a head dim the kernel
    handles (a multiple of 32, at most 256)."""
    if k_scales is None:
        kernel_ok = k_cache.dtype == torch.bfloat16 and is_available()
    else:
        kernel_ok = k_cache.dtype == torch.int8 and k_scales.is_contiguous() and _KERNEL_INT8.is_available()
    return (
        kernel_ok
        and q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and supports_heads(q.shape[1], k_cache.shape[1], k_cache.shape[-1])
        and k_cache.is_contiguous()
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] bf16, one query token per request
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D] bf16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    num_reqs, num_heads, head_dim = q.shape
    status = _KERNEL.fn()(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_reqs,
        num_heads,
        k_cache.shape[1],
        head_dim,
        k_cache.shape[2],
        block_tables.shape[1],
        max_seq_len,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"paged decode attention does not support heads={num_heads}, kv_heads={k_cache.shape[1]}, "
            f"head_dim={head_dim}; check should_use() first"
        )
    return out


def paged_decode_attention_int8(
    q: torch.Tensor,  # [B, H, D] bf16, one query token per request
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D] int8
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,  # [num_blocks, Hkv, block_size] float32: k = k_cache * k_scales
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [B, H, D] bf16
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    num_reqs, num_heads, head_dim = q.shape
    status = _KERNEL_INT8.fn()(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_scales.data_ptr(),
        v_scales.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_reqs,
        num_heads,
        k_cache.shape[1],
        head_dim,
        k_cache.shape[2],
        block_tables.shape[1],
        max_seq_len,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"paged decode attention does not support heads={num_heads}, kv_heads={k_cache.shape[1]}, "
            f"head_dim={head_dim}; check should_use() first"
        )
    return out
