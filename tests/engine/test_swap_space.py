"""SwapSpace (host block ids) and HostKVPool (the host tensors): exact ids, and blocks that come back bit for bit,
8-bit scales and a second (draft) cache included."""

from __future__ import annotations

import pytest
import torch

from leanlm.engine.swap_space import HostKVPool, SwapSpace
from leanlm.model.paged_kv import PagedKVCache


def test_swap_space_hands_out_and_takes_back_host_blocks():
    space = SwapSpace(4)
    assert space.allocate("a", 2) == [0, 1] and space.allocate("b", 1) == [2]
    assert space.num_free_blocks == 1 and not space.can_allocate(2) and space.get_block_ids("a") == [0, 1]
    with pytest.raises(RuntimeError, match="already holds host blocks"):
        space.allocate("a", 1)
    with pytest.raises(RuntimeError, match="only 1 are free"):
        space.allocate("c", 2)
    assert space.free("a") == [0, 1] and space.free("a") == []
    assert space.allocate("c", 3) == [3, 0, 1]  # freed blocks queue behind the never-used one
    with pytest.raises(ValueError, match=">= 1 host block"):
        SwapSpace(0)


def _filled(num_blocks: int, dtype: torch.dtype, seed: int, num_layers: int = 2) -> PagedKVCache:
    cache = PagedKVCache.allocate(num_layers, num_blocks, 2, 4, 8, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        cache.kv.copy_(torch.randint(-127, 128, cache.kv.shape, generator=gen, dtype=torch.int8))
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen))
    else:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen, dtype=dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_blocks_swapped_out_and_in_come_back_exactly_in_every_cache(dtype):
    target, draft = _filled(5, dtype, seed=0), _filled(5, torch.float32, seed=1, num_layers=1)
    before = [(c.kv.clone(), None if c.scales is None else c.scales.clone()) for c in (target, draft)]
    pool = HostKVPool((target, draft), num_blocks=3)
    assert not pool.is_pinned and pool.host_caches[0].kv.shape[2] == 3 and pool.host_caches[1].kv.shape[0] == 1
    pool.swap(swap_out=[(1, 0), (3, 2)], swap_in=[])
    for cache in (target, draft):  # the freed device blocks are reused and overwritten
        cache.kv.zero_()
        if cache.scales is not None:
            cache.scales.fill_(7.0)
    pool.swap(swap_out=[], swap_in=[(0, 4), (2, 0)])
    for cache, (kv, scales) in zip((target, draft), before):
        assert torch.equal(cache.kv[:, :, 4], kv[:, :, 1]) and torch.equal(cache.kv[:, :, 0], kv[:, :, 3])
        assert not cache.kv[:, :, 1].any()
        if scales is not None:
            assert torch.equal(cache.scales[:, :, 4], scales[:, :, 1])
            assert torch.equal(cache.scales[:, :, 0], scales[:, :, 3])


def test_swap_out_runs_before_swap_in_in_one_call():
    """A block one request swaps out may be the block another swaps into in the same step."""
    cache = _filled(2, torch.float32, seed=0)
    pool = HostKVPool((cache,), num_blocks=2)
    pool.swap(swap_out=[(0, 0)], swap_in=[])
    original = cache.kv[:, :, 0].clone(), cache.kv[:, :, 1].clone()
    pool.swap(swap_out=[(1, 1)], swap_in=[(0, 1)])  # block 1 leaves for host 1 as host 0 comes back into it
    assert torch.equal(cache.kv[:, :, 1], original[0])
    assert torch.equal(pool.host_caches[0].kv[:, :, 1], original[1])


def test_the_pool_is_sized_from_bytes():
    cache = _filled(4, torch.int8, seed=0)
    per_block = HostKVPool.bytes_per_block((cache,))
    assert per_block == 2 * 2 * 2 * 4 * (8 + 4)  # L, K/V, Hkv, block size, (D int8 values + a float32 scale)
    assert HostKVPool.sized((cache,), 3 * per_block + 1).num_blocks == 3
    with pytest.raises(ValueError, match="holds no KV block"):
        HostKVPool.sized((cache,), per_block - 1)
