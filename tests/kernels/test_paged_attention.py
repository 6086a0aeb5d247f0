"""The native paged decode attention kernel against a float64 reference and the torch backend."""

import math

import pytest
import torch

from leanlm.kernels import paged_attention
from leanlm.model.attention import get_backend
from leanlm.model.context import build_forward_context
from leanlm.model.paged_kv import PagedKVCache

pytestmark = pytest.mark.skipif(
    not paged_attention.is_available(), reason=f"{paged_attention._KERNEL.unavailable_reason}"
)


def _reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Dense float64 attention of each request's single query over its first seq_len cached tokens."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv, block_size = k_cache.shape[1], k_cache.shape[2]
    k_cache, v_cache = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()  # [N, bs, Hkv, D]
    out = torch.empty(num_reqs, num_heads, head_dim, dtype=torch.float64)
    for b in range(num_reqs):
        slots = (block_tables[b][:, None] * block_size + torch.arange(block_size)).reshape(-1)[: seq_lens[b]]
        keys = k_cache.view(-1, num_kv, head_dim)[slots].double().repeat_interleave(num_heads // num_kv, 1)
        values = v_cache.view(-1, num_kv, head_dim)[slots].double().repeat_interleave(num_heads // num_kv, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), keys) * scale, -1)
        out[b] = torch.einsum("ht,thd->hd", probs, values)
    return out


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (14, 2, 64), (4, 4, 128), (8, 1, 32)])
@pytest.mark.parametrize("lengths", [[1], [5, 17, 33], [200, 3, 64, 129]])
def test_matches_float64_reference(num_heads, num_kv, head_dim, lengths):
    gen = torch.Generator().manual_seed(len(lengths) * head_dim)
    num_blocks, block_size = 64, 16
    k_cache = torch.randn(num_blocks, num_kv, block_size, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, num_kv, block_size, head_dim, generator=gen).bfloat16()
    max_blocks = math.ceil(max(lengths) / block_size)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in lengths])
    seq_lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max(lengths), scale)
    ref = _reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    # bf16 output rounding (values are O(1)): 2^-8 relative, plus fp32 accumulation
    torch.testing.assert_close(got.double(), ref, atol=1e-2, rtol=8e-3)


def test_cpu_backend_agrees_with_the_torch_backend():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(32, 3, 16, 64, generator=gen).bfloat16()
    v_cache = torch.randn(32, 3, 16, 64, generator=gen).bfloat16()
    lengths = [40, 7, 90]
    blocks = [[3, 9, 12], [5], [0, 1, 2, 4, 6, 8]]
    q = torch.randn(3, 9, 64, generator=gen).bfloat16()
    k_new = torch.randn(3, 3, 64, generator=gen).bfloat16()
    v_new = torch.randn(3, 3, 64, generator=gen).bfloat16()
    outs = []
    for name in ("torch", "cpu"):
        cache = PagedKVCache(torch.stack([k_cache, v_cache])[None])  # a copy for each backend to write into
        ctx = build_forward_context([1, 1, 1], lengths, blocks, cache)
        outs.append(get_backend(name).forward(q, k_new, v_new, cache.layer(0), 0.125, ctx).double())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=1e-2)


def test_unsupported_shapes_fall_back():
    q = torch.zeros(1, 9, 48, dtype=torch.bfloat16)  # head dim not a multiple of 32
    assert not paged_attention.should_use(q, torch.zeros(4, 3, 16, 48, dtype=torch.bfloat16))
    assert not paged_attention.should_use(q.float(), torch.zeros(4, 3, 16, 48))


def _int8_cache(gen, num_blocks, num_kv, block_size, head_dim):
    """An int8 cache with per-(token, head) scales, and the float K/V it stands for."""
    from leanlm.model.kv_quant import dequantize_kv, quantize_kv

    x = torch.randn(num_blocks, num_kv, block_size, head_dim, generator=gen)
    x[:, 0] *= 20  # an outlier head: its own scales
    values, scales = quantize_kv(x, torch.int8)
    return values, scales, dequantize_kv(values, scales, torch.float32)


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (14, 2, 64), (4, 4, 128), (8, 1, 32)])
@pytest.mark.parametrize("lengths", [[1], [5, 17, 33], [200, 3, 64, 129]])
def test_int8_kv_matches_float64_reference(num_heads, num_kv, head_dim, lengths):
    gen = torch.Generator().manual_seed(7 + len(lengths) * head_dim)
    num_blocks, block_size = 64, 16
    k_cache, k_scales, k_float = _int8_cache(gen, num_blocks, num_kv, block_size, head_dim)
    v_cache, v_scales, v_float = _int8_cache(gen, num_blocks, num_kv, block_size, head_dim)
    max_blocks = math.ceil(max(lengths) / block_size)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in lengths])
    seq_lens = torch.tensor(lengths)
    q = (torch.randn(len(lengths), num_heads, head_dim, generator=gen) * 0.2).bfloat16()
    scale = head_dim**-0.5
    assert paged_attention.should_use(q, k_cache, k_scales)
    got = paged_attention.paged_decode_attention_int8(
        q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, max(lengths), scale
    )
    ref = _reference(q, k_float, v_float, block_tables, seq_lens, scale)  # the dequantized cache, float64
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=8e-3)


def test_cpu_backend_int8_kv_agrees_with_the_torch_backend():
    gen = torch.Generator().manual_seed(1)
    k_cache, k_scales, _ = _int8_cache(gen, 32, 3, 16, 64)
    v_cache, v_scales, _ = _int8_cache(gen, 32, 3, 16, 64)
    lengths = [40, 7, 90]
    blocks = [[3, 9, 12], [5], [0, 1, 2, 4, 6, 8]]
    q = (torch.randn(3, 9, 64, generator=gen) * 0.2).bfloat16()  # small: a sharp softmax amplifies bf16 K rounding
    k_new = torch.randn(3, 3, 64, generator=gen).bfloat16()
    v_new = torch.randn(3, 3, 64, generator=gen).bfloat16()
    outs = []
    for name in ("torch", "cpu"):
        # a copy for each backend to write into
        cache = PagedKVCache(torch.stack([k_cache, v_cache])[None], torch.stack([k_scales, v_scales])[None])
        ctx = build_forward_context([1, 1, 1], lengths, blocks, cache)
        outs.append(get_backend(name).forward(q, k_new, v_new, cache.layer(0), 0.125, ctx).double())
    # per query head, relative to its largest output (the 20x head's outputs are 20x larger): bf16 roundings
    error = (outs[0] - outs[1]).abs().amax(dim=(0, 2)) / outs[1].abs().amax(dim=(0, 2))
    assert (error < 2e-2).all(), error


def test_int8_kernel_policy():
    q = torch.zeros(1, 9, 64, dtype=torch.bfloat16)
    cache, scales = torch.zeros(4, 3, 16, 64, dtype=torch.int8), torch.ones(4, 3, 16)
    assert paged_attention.should_use(q, cache, scales)
    assert not paged_attention.should_use(q, cache)  # int8 values without scales: not a cache the kernel reads
    assert not paged_attention.should_use(q, cache.view(torch.float8_e4m3fn), scales)  # fp8: the torch path
    assert not paged_attention.should_use(q.float(), cache, scales)
