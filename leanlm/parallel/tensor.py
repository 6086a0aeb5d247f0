"""Megatron-style tensor parallelism of the decoder (Shoeybi et al. 2019): q/k/v and gate/up column-parallel,
o_proj and down_proj row-parallel with one all-reduce each, a vocabulary-parallel embedding (one all-reduce) and
LM head (one all-gather). Every linear is cut by its own weight format's shard(), which refuses, with the reason,
a cut its format cannot make."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from leanlm.model.layers import Linear
from leanlm.model.linear.shard import COLUMN, ROW, part
from leanlm.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from leanlm.model.mla import LatentAttention
from leanlm.model.moe import SparseMoeBlock
from leanlm.parallel.heads import HeadShard, split_heads


@dataclass
class CommStats:
    """What a rank's tensor group moved since start (the estimate's byte counts are checked against these)."""

    num_all_reduces: int = 0
    all_reduce_bytes: int = 0  # payload: the reduced tensors' bytes
    num_all_gathers: int = 0
    all_gather_bytes: int = 0  # this rank's contribution
    num_all_to_alls: int = 0  # expert parallelism's dispatch and combine (leanlm.parallel.expert)
    all_to_all_bytes: int = 0  # rows this rank sent


@dataclass(frozen=True)
class TensorGroup:
    """The ranks one layer is split across: this process's place among them, and their process group (None when
    the group is this process alone)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    stats: CommStats = field(default_factory=CommStats, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, in float32 for half-precision x (the partial sums are rounded once, at the end)."""
        if self.size == 1:
            return x
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous()
        dist.all_reduce(wide, group=self.group)
        self.stats.num_all_reduces += 1
        self.stats.all_reduce_bytes += wide.numel() * wide.element_size()
        return wide.to(x.dtype) if wide is not x else wide

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, n] of every rank, concatenated along the last axis in rank order: [N, sum of n]."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self.stats.num_all_gathers += 1
        self.stats.all_gather_bytes += x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """A row shard (a slice of the inputs) whose partial outputs are summed over the group: the layer's output."""

    def __init__(self, shard: nn.Module, tp: TensorGroup, out_features: int) -> None:
        super().__init__()
        self.shard = shard
        self.tp = tp
        self.in_features, self.out_features = shard.in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        return self.tp.all_reduce(self.shard(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding on this rank; a token outside them reads zeros, and the all-reduce
    gives every rank each token's one row."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / tp, hidden]
        self.start, self.tp = start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class VocabParallelHead(nn.Module):
    """A column shard of the LM head (this rank's vocabulary slice); the all-gather gives every rank whole logits."""

    def __init__(self, shard: nn.Module, tp: TensorGroup) -> None:
        super().__init__()
        self.shard, self.tp = shard, tp
        self.in_features, self.out_features = shard.in_features, shard.out_features * tp.size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        return self.tp.all_gather_last(self.shard(hidden))


def own_shard(layer: nn.Module) -> nn.Module:
    """A shard holding its own memory: a slice of a dense weight is a view that would keep the whole tensor alive."""
    for name, p in list(layer.named_parameters(recurse=False)):
        setattr(layer, name, nn.Parameter(p.detach().clone(), requires_grad=False))
    return layer


def shard_attention(attn: LlamaAttention, heads: list[HeadShard], tp: TensorGroup) -> None:
    """Cut attn in place to rank tp.rank's heads (see leanlm.parallel.heads)."""
    mine, d = heads[tp.rank], attn.head_dim
    q_sizes = tuple(h.num_heads * d for h in heads)
    attn.q_proj = own_shard(attn.q_proj.shard(COLUMN, tp.rank, tp.size, q_sizes))
    if len({(h.kv_start, h.kv_stop) for h in heads}) == len(heads):  # KV groups partitioned
        kv_sizes = tuple(h.num_kv_heads * d for h in heads)
        attn.k_proj = own_shard(attn.k_proj.shard(COLUMN, tp.rank, tp.size, kv_sizes))
        attn.v_proj = own_shard(attn.v_proj.shard(COLUMN, tp.rank, tp.size, kv_sizes))
    else:  # each KV head replicated on the ranks that split its query heads
        num_kv = attn.num_kv_heads
        attn.k_proj = own_shard(attn.k_proj.shard(COLUMN, mine.kv_start, num_kv))
        attn.v_proj = own_shard(attn.v_proj.shard(COLUMN, mine.kv_start, num_kv))
    hidden = attn.o_proj.out_features
    attn.o_proj = RowParallelLinear(own_shard(attn.o_proj.shard(ROW, tp.rank, tp.size, q_sizes)), tp, hidden)
    attn.num_heads, attn.num_kv_heads = mine.num_heads, mine.num_kv_heads


def shard_latent_attention(attn: LatentAttention, heads: list[HeadShard], tp: TensorGroup) -> None:
    """MLA cut to rank tp.rank's heads: the query's and kv_b_proj's per-head rows, o_proj's per-head columns. The
    latent (kv_a_proj_with_mqa, its norm, the query bottleneck) is every head's: each rank keeps it whole and caches
    the same latent rows."""
    mine = heads[tp.rank]
    q_sizes = tuple(h.num_heads * attn.head_dim for h in heads)
    name = "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"
    setattr(attn, name, own_shard(getattr(attn, name).shard(COLUMN, tp.rank, tp.size, q_sizes)))
    kv_sizes = tuple(h.num_heads * (attn.nope + attn.v_dim) for h in heads)
    attn.kv_b_proj = own_shard(attn.kv_b_proj.shard(COLUMN, tp.rank, tp.size, kv_sizes))
    o_sizes = tuple(h.num_heads * attn.v_dim for h in heads)
    hidden = attn.o_proj.out_features
    attn.o_proj = RowParallelLinear(own_shard(attn.o_proj.shard(ROW, tp.rank, tp.size, o_sizes)), tp, hidden)
    attn.num_heads = attn.num_kv_heads = mine.num_heads


def shard_mlp(mlp: LlamaMLP, tp: TensorGroup) -> None:
    """gate/up column-parallel, down row-parallel: the FFN's intermediate features split evenly."""
    hidden = mlp.down_proj.out_features
    mlp.gate_proj = own_shard(mlp.gate_proj.shard(COLUMN, tp.rank, tp.size))
    mlp.up_proj = own_shard(mlp.up_proj.shard(COLUMN, tp.rank, tp.size))
    mlp.down_proj = RowParallelLinear(own_shard(mlp.down_proj.shard(ROW, tp.rank, tp.size)), tp, hidden)


def shard_vocab(model: LlamaForCausalLM, tp: TensorGroup) -> None:
    """The embedding and LM head cut to this rank's vocabulary slice; a tied head shares the embedding's slice."""
    config = model.config
    rows = part(config.vocab_size, COLUMN, tp.rank, tp.size, 1, "vocabulary-parallel embedding")
    weight = model.model.embed_tokens.weight.detach()[rows].clone()  # [V / tp, hidden]
    model.model.embed_tokens = VocabParallelEmbedding(weight, rows.start, tp)
    if config.tie_word_embeddings and isinstance(model.lm_head, Linear):  # a dense head reads the embedding's rows
        head = model.lm_head.shard(COLUMN, tp.rank, tp.size)
        head.weight = model.model.embed_tokens.weight
    else:
        head = own_shard(model.lm_head.shard(COLUMN, tp.rank, tp.size))
    model.lm_head = VocabParallelHead(head, tp)


def shard_model(model: LlamaForCausalLM, tp: TensorGroup, expert_parallel: bool = False) -> LlamaForCausalLM:
    """Cut `model` in place to rank tp.rank's part of every layer. Its config becomes the rank's shape (its query and
    KV heads: what its KV cache holds); vocabulary, hidden and FFN sizes stay the whole model's. MoE layers split
    every expert (or, with `expert_parallel`, hand each rank whole experts: leanlm.parallel.expert)."""
    from leanlm.parallel.expert import shard_moe  # expert.py builds on this module's groups and shards

    if tp.size == 1:
        return model
    config = model.config
    if config.qk_norm == "whole":  # per-head norms (Qwen3, Gemma 3) are the same on every head: they shard as is
        raise ValueError(
            "OLMoE's q/k norms run over every head at once, which a tensor shard holds only part of: serve it with "
            "tensor_parallel_size 1 (pipeline_parallel_size splits its layers instead)"
        )
    heads = split_heads(config.num_attention_heads, config.num_key_value_heads, tp.size)
    for layer in model.model.layers:
        if isinstance(layer.self_attn, LatentAttention):
            shard_latent_attention(layer.self_attn, heads, tp)
        else:
            shard_attention(layer.self_attn, heads, tp)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = shard_moe(layer.mlp, tp, expert_parallel)
        else:
            shard_mlp(layer.mlp, tp)
    shard_vocab(model, tp)
    mine = heads[tp.rank]
    heads_of_rank = dict(num_attention_heads=mine.num_heads, num_key_value_heads=mine.num_kv_heads)
    model.config = dataclasses.replace(config, **heads_of_rank)
    model.disable_native_decode()  # the native loop runs whole layers: it has no all-reduce between them
    return model


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """KV heads the largest rank's cache holds: every rank sizes its KV pool for it, so all pools have the same
    number of blocks (the scheduler's block ids name the same slots on every rank)."""
    return max(h.num_kv_heads for h in split_heads(num_heads, num_kv_heads, tp_size))
