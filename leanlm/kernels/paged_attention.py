"""Paged decode attention for bfloat16 KV caches on AVX512-BF16 CPUs (paged_attention_bf16.c via ctypes).

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
MAX_GROUP = 16  # query heads per KV head the kernel supports
MAX_HEAD_DIM = 256


def is_available() -> bool:
    return _KERNEL.is_available()


def should_use(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """bf16 CPU tensors with a head dim the kernel handles (a multiple of 32, at most 256)."""
    head_dim = k_cache.shape[-1]
    group = q.shape[1] // k_cache.shape[1]
    return (
        q.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and head_dim % 32 == 0
        and head_dim <= MAX_HEAD_DIM
        and group <= MAX_GROUP
        and k_cache.is_contiguous()
        and is_available()
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
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), num_reqs, num_heads, k_cache.shape[1], head_dim, k_cache.shape[2], block_tables.shape[1],
        max_seq_len, scale, torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged decode attention does not support heads={num_heads}, kv_heads={k_cache.shape[1]}, "
                         f"head_dim={head_dim}; check should_use() first")
    return out
