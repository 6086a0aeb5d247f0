"""How attention heads split across tensor-parallel ranks (Megatron-LM): each rank takes whole KV groups (a KV
head and the query heads that read it), so attention needs no communication. With fewer KV heads than ranks,
each KV head is replicated on world / Hkv ranks, which split its query heads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank computes: query heads [q_start, q_stop) and KV heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def _even_parts(total: int, count: int) -> list[int]:
    """`total` split into `count` parts differing by at most one, the larger first."""
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


def split_heads(num_heads: int, num_kv_heads: int, world: int) -> list[HeadShard]:
    """Per rank, its heads. Ranks <= KV heads: contiguous KV groups, as even as the count allows (9 heads in 3 KV
    groups on 2 ranks: 6 + 3 query heads). Ranks > KV heads: world must be a multiple of the KV heads; each KV head
    is replicated on world / Hkv ranks, which split its group's query heads as evenly as they can."""
    if world < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"cannot split {num_heads} heads / {num_kv_heads} KV heads over {world} ranks")
    group = num_heads // num_kv_heads  # query heads per KV head
    if world <= num_kv_heads:
        shards, kv = [], 0
        for count in _even_parts(num_kv_heads, world):
            shards.append(HeadShard(kv * group, (kv + count) * group, kv, kv + count))
            kv += count
        return shards
    if world % num_kv_heads or world > num_heads:
        raise ValueError(
            f"tensor_parallel_size={world} does not fit {num_heads} query heads in {num_kv_heads} KV groups: with more "
            f"ranks than KV heads the ranks must be a multiple of the KV heads ({num_kv_heads}) and at most the query "
            f"heads; choose a tensor_parallel_size that divides {num_kv_heads} or such a multiple"
        )
    per_kv = world // num_kv_heads
    if per_kv > group:
        raise ValueError(f"tensor_parallel_size={world} leaves a rank without a query head (groups of {group})")
    shards = []
    for kv in range(num_kv_heads):
        q = kv * group
        for count in _even_parts(group, per_kv):
            shards.append(HeadShard(q, q + count, kv, kv + 1))
            q += count
    return shards
