"""The native paged kernel under attention patterns (window, sinks, strided keys, a sink query) against the PyTorch
reference (leanlm.model.sparse_attention), on bf16 and int8 caches."""

import pytest
import torch

from leanlm.kernels import paged_attention
from leanlm.model.attention_pattern import AttentionPattern, row_bounds
from leanlm.model.kv_quant import quantize_kv
from leanlm.model.paged_kv import LayerKV
from leanlm.model.sparse_attention import sparse_attention

pytestmark = pytest.mark.skipif(not paged_attention.is_available(), reason="needs the native paged kernel")

H, HKV, D, BS = 6, 2, 64, 16
PATTERNS = [
    AttentionPattern(40),
    AttentionPattern(40, sinks=4),
    AttentionPattern(33, sinks=3, rebase_sinks=True),
    AttentionPattern(24, sinks=2, stride=24),
    AttentionPattern(17, stride=5),
    AttentionPattern(1000, sinks=4),  # wider than every sequence: every key
]


def _cache(num_blocks: int, int8: bool, gen: torch.Generator) -> LayerKV:
    k = torch.randn(num_blocks, HKV, BS, D, generator=gen).bfloat16()
    v = torch.randn(num_blocks, HKV, BS, D, generator=gen).bfloat16()
    if not int8:
        return LayerKV(k, v, None, None)
    kq, ks = quantize_kv(k, torch.int8)
    vq, vs = quantize_kv(v, torch.int8)
    return LayerKV(kq, vq, ks, vs)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_kernel_matches_the_reference_under_a_pattern(pattern, int8):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 17, 40, 41, 90, 130]
    num_blocks = sum(-(-n // BS) for n in seq_lens) + 3
    kv = _cache(num_blocks, int8, gen)
    perm = torch.randperm(num_blocks, generator=gen)  # scattered, non-monotonic blocks
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // BS)
        tables.append(perm[used : used + nb])
        used += nb
    width = max(len(t) for t in tables)
    table = torch.stack([torch.cat((t, t.new_zeros(width - len(t)))) for t in tables])
    q = torch.randn(len(seq_lens), H, D, generator=gen).bfloat16()
    q_sink = torch.randn(len(seq_lens), H, D, generator=gen).bfloat16() if pattern.rebase_sinks else None
    lens = torch.tensor(seq_lens)
    bounds = row_bounds(lens, pattern)
    args = (table, lens, max(seq_lens), 0.125, bounds, q_sink)
    if int8:
        out = paged_attention.paged_decode_attention_int8(q, kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales, *args)
    else:
        out = paged_attention.paged_decode_attention(q, kv.k_cache, kv.v_cache, *args)
    for b, n in enumerate(seq_lens):
        qs = None if q_sink is None else q_sink[b : b + 1]
        ref = sparse_attention(q[b : b + 1], qs, kv, tables[b], n, 0.125, pattern)
        torch.testing.assert_close(out[b].float(), ref[0].float(), atol=2e-2, rtol=2e-2)


def test_a_window_reads_no_key_before_it():
    """Keys outside the pattern may hold anything (freed blocks are reused): poisoning them changes nothing."""
    gen = torch.Generator().manual_seed(1)
    kv = _cache(8, False, gen)
    table = torch.arange(8).unsqueeze(0)
    q = torch.randn(1, H, D, generator=gen).bfloat16()
    pattern = AttentionPattern(32, sinks=4)
    bounds = row_bounds(torch.tensor([128]), pattern)
    args = (table, torch.tensor([128]), 128, 0.125, bounds)
    before = paged_attention.paged_decode_attention(q, kv.k_cache, kv.v_cache, *args)
    kv.k_cache[1:6] = float("nan")  # positions 16 .. 95: neither sinks (0-3) nor the window (96-127)
    kv.v_cache[1:6] = float("nan")
    kv.k_cache[0, :, 4:] = float("nan")
    after = paged_attention.paged_decode_attention(q, kv.k_cache, kv.v_cache, *args)
    assert torch.equal(before, after)
