"""Paged decode attention for bfloat16 KV caches, and int8 ones with per-(token, KV head) scales, on AVX512-BF16
CPUs (paged_attention_bf16.c via ctypes), over every cached key or a bounded pattern of them (sinks, strided keys,
a window: leanlm.model.attention_pattern).

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
    argtypes=[ctypes.c_void_p] * 6
    + [ctypes.c_int] * 6
    + [ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    + [ctypes.c_void_p] * 2,
    restype=ctypes.c_int,
)
_KERNEL_INT8 = NativeKernel(
    source=_KERNEL.source,
    symbol="paged_decode_attention_int8kv",
    argtypes=[ctypes.c_void_p] * 8
    + [ctypes.c_int] * 6
    + [ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    + [ctypes.c_void_p] * 2,
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


def _checked_extras(q: torch.Tensor, bounds: torch.Tensor | None, q_sink: torch.Tensor | None) -> tuple:
    """The optional arguments as the kernel reads them: bounds [B, 3] int64 contiguous, q_sink q's shape and dtype."""
    if bounds is not None:
        bounds = bounds.contiguous()
        if bounds.dtype is not torch.int64 or bounds.shape != (q.shape[0], 3):
            raise ValueError(
                f"bounds must be int64 [{q.shape[0]}, 3] (lo, sinks, stride), got {bounds.dtype} {tuple(bounds.shape)}"
            )
    if q_sink is not None:
        q_sink = q_sink.contiguous()
        if q_sink.shape != q.shape or q_sink.dtype != q.dtype:
            raise ValueError(
                f"q_sink must be like q {tuple(q.shape)} {q.dtype}, got {tuple(q_sink.shape)} {q_sink.dtype}"
            )
    return (
        bounds,
        q_sink,
        None if bounds is None else bounds.data_ptr(),
        None if q_sink is None else q_sink.data_ptr(),
    )


def _failed(num_heads: int, k_cache: torch.Tensor, head_dim: int) -> ValueError:
    return ValueError(
        f"paged decode attention does not support heads={num_heads}, kv_heads={k_cache.shape[1]}, "
        f"head_dim={head_dim}; check should_use() first"
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] bf16, one query token per request
    k_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D] bf16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64
    max_seq_len: int,
    scale: float,
    bounds: torch.Tensor | None = None,  # [B, 3] int64 (lo, sinks, stride): the keys each row reads; None: all
    q_sink: torch.Tensor | None = None,  # [B, H, D]: the query the sinks are scored with; None: q
) -> torch.Tensor:  # [B, H, D]
    """Row b reads keys [0, seq_lens[b]), or with bounds the sinks [0, min(sinks, lo)), every stride-th key below lo
    (leanlm.model.attention_pattern), and the window [lo, seq_lens[b])."""
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    num_reqs, num_heads, head_dim = q.shape
    keep = _checked_extras(q, bounds, q_sink)
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
        *keep[2:],
    )
    if status != 0:
        raise _failed(num_heads, k_cache, head_dim)
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
    bounds: torch.Tensor | None = None,  # as paged_decode_attention's
    q_sink: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, H, D] bf16
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    num_reqs, num_heads, head_dim = q.shape
    keep = _checked_extras(q, bounds, q_sink)
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
        *keep[2:],
    )
    if status != 0:
        raise _failed(num_heads, k_cache, head_dim)
    return out
