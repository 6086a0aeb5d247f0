"""Mixture-of-experts layers over a tensor-parallel group, two ways.

Tensor-parallel experts (the default): every expert, and the shared expert, is cut like a dense MLP (gate/up by
columns, down by rows), every rank runs every chosen expert on its slice of the intermediate features, and the
layer's output is all-reduced once (not once per expert).

Expert parallelism (GShard; `enable_expert_parallel`): rank r holds whole experts [E r / P, E (r+1) / P). The
hidden state arrives replicated (the attention's all-reduce), so every rank routes every token the same way and
applies the capacity over the whole step, as one process would; then each rank takes its 1/P of the tokens, sends
each kept (token, expert) row to the expert's owner (all-to-all dispatch), runs its own experts on what it
received, sends the rows back (all-to-all combine), weights and sums them per token, and an all-gather makes the
layer's output replicated again for the next layer's attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from leanlm.model.linear.shard import COLUMN, ROW
from leanlm.model.mlp import LlamaMLP
from leanlm.model.moe import SparseMoeBlock
from leanlm.parallel.tensor import TensorGroup, own_shard


def expert_bounds(num_experts: int, world: int) -> list[int]:
    """Rank r owns experts [bounds[r], bounds[r+1]); ranks differ by at most one expert."""
    if num_experts < world:
        raise ValueError(
            f"expert parallelism over {world} ranks needs at least {world} experts per layer, the model has "
            f"{num_experts}: use tensor-parallel experts (drop --enable-expert-parallel)"
        )
    return [r * num_experts // world for r in range(world + 1)]


def token_bounds(num_tokens: int, world: int) -> list[int]:
    """Rank r dispatches tokens [bounds[r], bounds[r+1]) of the step."""
    return [r * num_tokens // world for r in range(world + 1)]


class RemoteExpert(nn.Module):
    """An expert another rank holds: the rows for it leave this process by all-to-all, never through here."""

    def __init__(self, index: int, owner: int) -> None:
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"expert {self.index} lives on rank {self.owner}; its rows go there by all-to-all")


def shard_swiglu(mlp: LlamaMLP, tp: TensorGroup) -> None:
    """gate/up column-parallel, down row-parallel without its own all-reduce: the caller reduces the layer once."""
    mlp.gate_proj = own_shard(mlp.gate_proj.shard(COLUMN, tp.rank, tp.size))
    mlp.up_proj = own_shard(mlp.up_proj.shard(COLUMN, tp.rank, tp.size))
    mlp.down_proj = own_shard(mlp.down_proj.shard(ROW, tp.rank, tp.size))


class TensorParallelMoE(nn.Module):
    """Every expert split across the group; one all-reduce of the layer's output."""

    def __init__(self, block: SparseMoeBlock, tp: TensorGroup) -> None:
        super().__init__()
        for expert in block.experts:
            shard_swiglu(expert, tp)
        if block.shared_expert is not None:
            shard_swiglu(block.shared_expert, tp)  # its sigmoid gate scales the partial sums alike
        self.block, self.tp = block, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.tp.all_reduce(self.block(x))


class ExpertParallelMoE(nn.Module):
    """Whole experts per rank, all-to-all dispatch and combine (see the module doc)."""

    def __init__(self, block: SparseMoeBlock, tp: TensorGroup) -> None:
        super().__init__()
        num_experts = block.moe.num_experts
        self.tp = tp
        self.bounds = expert_bounds(num_experts, tp.size)
        lo, hi = self.bounds[tp.rank], self.bounds[tp.rank + 1]
        for e in range(num_experts):  # drop the others' weights: each rank keeps 1/P of the experts' memory
            if not lo <= e < hi:
                block.experts[e] = RemoteExpert(e, self.owner(e))
        self.block = block
        self.owners = torch.tensor([self.owner(e) for e in range(num_experts)])  # [E]

    def owner(self, expert: int) -> int:
        return next(r for r in range(self.tp.size) if self.bounds[r] <= expert < self.bounds[r + 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] replicated -> [T, hidden] replicated
        block, moe, num_tokens = self.block, self.block.moe, x.shape[0]
        experts, weights, keep = block.choose(x)  # every rank routes every token, as one process would
        keep = torch.ones_like(experts, dtype=torch.bool) if keep is None else keep
        counts = torch.bincount(experts[keep], minlength=moe.num_experts).tolist()
        block.stats.add(counts, num_tokens, num_tokens * moe.top_k)
        t0, t1 = token_bounds(num_tokens, self.tp.size)[self.tp.rank : self.tp.rank + 2]
        mine = x[t0:t1]  # [t, hidden]
        out = self.exchange(mine, experts[t0:t1], weights[t0:t1], keep[t0:t1])
        shared = block.shared_output(mine)
        return self.gather_tokens(out if shared is None else out + shared, num_tokens)

    def exchange(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """This rank's tokens x [t, hidden] through their kept experts wherever they live: [t, hidden]."""
        k = experts.shape[1]
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[keep.reshape(-1)]  # [A]
        flat_experts, flat_weights = experts.reshape(-1)[keep.reshape(-1)], weights.reshape(-1)[keep.reshape(-1)]
        order = torch.argsort(flat_experts, stable=True)  # by expert, so by owner too (owners hold ranges)
        tokens, flat_experts, flat_weights = tokens[order], flat_experts[order], flat_weights[order]
        send = torch.bincount(self.owners.to(x.device)[flat_experts], minlength=self.tp.size)  # [P]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.tp.group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        got_experts = self.all_to_all(flat_experts, recv_sizes, send_sizes)  # [B] experts of the rows sent here
        got_rows = self.all_to_all(x[tokens], recv_sizes, send_sizes)  # [B, hidden]
        done = self.run_local(got_rows, got_experts)
        back = self.all_to_all(done, send_sizes, recv_sizes)  # [A, hidden], in the order sent
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, (back * flat_weights[:, None]).to(x.dtype))
        return out

    def run_local(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [B, hidden] through this rank's experts `experts` [B], one product per expert, in place order."""
        out = torch.empty_like(rows)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.block.moe.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = order[start : start + n]
                out[idx] = self.block.experts[e](rows[idx])
            start += n
        return out

    def all_to_all(self, x: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> torch.Tensor:
        """Rows of x (in_sizes[r] of them for rank r, in rank order) out; out_sizes[r] rows from each rank r back.
        gloo has no half-precision all-to-all: such rows travel in float32 there."""
        wide = x.is_floating_point() and x.dtype in (torch.bfloat16, torch.float16) and self._is_gloo()
        send = (x.float() if wide else x).contiguous()
        got = send.new_empty((sum(out_sizes), *send.shape[1:]))
        dist.all_to_all_single(got, send, out_sizes, in_sizes, group=self.tp.group)
        self.tp.stats.num_all_to_alls += 1
        self.tp.stats.all_to_all_bytes += send.numel() * send.element_size()
        return got.to(x.dtype) if wide else got

    def gather_tokens(self, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's token slice [t_r, hidden] -> [T, hidden] on every rank (slices padded to one size)."""
        bounds = token_bounds(num_tokens, self.tp.size)
        width = max(b - a for a, b in zip(bounds, bounds[1:]))
        wide = out.dtype in (torch.bfloat16, torch.float16) and self._is_gloo()
        padded = out.new_zeros(width, out.shape[1], dtype=torch.float32 if wide else out.dtype)
        padded[: out.shape[0]] = out
        parts = [torch.empty_like(padded) for _ in range(self.tp.size)]
        dist.all_gather(parts, padded, group=self.tp.group)
        self.tp.stats.num_all_gathers += 1
        self.tp.stats.all_gather_bytes += padded.numel() * padded.element_size()
        whole = torch.cat([p[: b - a] for p, a, b in zip(parts, bounds, bounds[1:])])
        return whole.to(out.dtype)

    def _is_gloo(self) -> bool:
        return dist.get_backend(self.tp.group) == "gloo"


def shard_moe(block: SparseMoeBlock, tp: TensorGroup, expert_parallel: bool) -> nn.Module:
    """The module standing for `block` on rank tp.rank (it keeps the block, whose router and counters it uses)."""
    return ExpertParallelMoE(block, tp) if expert_parallel else TensorParallelMoE(block, tp)
