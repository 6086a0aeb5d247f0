"""What expert parallelism's all-to-all costs (pure functions over a ModelShape): per MoE layer and decode step, the
bytes one rank sends to dispatch its tokens to their experts and to combine the results, and the messages it
sends, in a flat all-to-all (every rank to each of its P - 1 peers) against a hierarchical one (DeepSpeed-MoE,
Rajbhandari et al. 2022; Tutel's 2DH all-to-all, Hwang et al. 2023): an intra-node all-to-all that gathers, on
local rank j, the node's data for local rank j of every node, then an inter-node all-to-all between the G ranks
of local index j, so a rank sends G - 1 inter-node messages, each n times larger, instead of P - n.

Layout: P ranks = G nodes x n ranks each; each rank holds E / P experts of every MoE layer and T / P of a step's T
tokens (attention runs data-parallel over the EP ranks, as in GShard and DeepSpeed-MoE). Routing is uniform, and a
token sends one copy of its hidden state per chosen expert (k copies, no de-duplication by destination rank).
Time is an alpha-beta model: each message costs its link's latency, each byte its link's inverse bandwidth, the
messages of a phase one after another (NCCL groups them, so this is the upper end).
"""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.analysis.model_shape import ModelShape

# Defaults for the link between nodes: one 400 Gb/s InfiniBand NDR port per GPU (50 GB/s), ~10 us per message.
INTER_NODE_LINK = (50e9, 10e-6)


@dataclass(frozen=True)
class ExpertParallelLayout:
    expert_parallel_size: int  # P ranks, each holding E / P experts of every MoE layer
    nodes: int  # G; n = P / G ranks per node
    intra_bandwidth: float  # bytes/s between two ranks of a node
    intra_latency_s: float  # one intra-node message
    inter_bandwidth: float  # bytes/s from one rank to a rank of another node
    inter_latency_s: float  # one inter-node message

    def __post_init__(self) -> None:
        if self.expert_parallel_size < 2:
            raise ValueError(f"--expert-parallel-size must be >= 2 to exchange tokens, got {self.expert_parallel_size}")
        if self.nodes < 1 or self.expert_parallel_size % self.nodes:
            raise ValueError(
                f"--expert-parallel-nodes ({self.nodes}) must divide --expert-parallel-size "
                f"({self.expert_parallel_size}): every node holds the same number of ranks"
            )
        if min(self.intra_bandwidth, self.inter_bandwidth) <= 0 or min(self.intra_latency_s, self.inter_latency_s) < 0:
            raise ValueError("link bandwidths must be > 0 and latencies >= 0")

    @property
    def ranks_per_node(self) -> int:
        return self.expert_parallel_size // self.nodes


@dataclass(frozen=True)
class AllToAllPlan:
    """One direction (dispatch or combine) of one MoE layer, for one rank: messages and bytes it sends by link."""

    intra_messages: int
    inter_messages: int
    intra_bytes: float
    inter_bytes: float

    def time_s(self, layout: ExpertParallelLayout) -> float:
        return (
            self.intra_messages * layout.intra_latency_s
            + self.inter_messages * layout.inter_latency_s
            + self.intra_bytes / layout.intra_bandwidth
            + self.inter_bytes / layout.inter_bandwidth
        )


def rank_payload_bytes(s: ModelShape, num_tokens: int, layout: ExpertParallelLayout, act_bytes: int) -> float:
    """A: what one rank's T / P tokens send in one direction, its own experts' share included: (T / P) k d bytes."""
    return num_tokens / layout.expert_parallel_size * s.experts_per_token * s.hidden_size * act_bytes


def flat_all_to_all(payload: float, layout: ExpertParallelLayout) -> AllToAllPlan:
    """Each rank sends A / P to each of its P - 1 peers: n - 1 of them on its node, P - n on other nodes."""
    p, n = layout.expert_parallel_size, layout.ranks_per_node
    return AllToAllPlan(n - 1, p - n, payload * (n - 1) / p, payload * (p - n) / p)


def hierarchical_all_to_all(payload: float, layout: ExpertParallelLayout) -> AllToAllPlan:
    """Phase 1, intra-node: each rank sends A / n to each of its n - 1 node peers (what is bound for their local
    index on any node). Phase 2, inter-node: local rank j now holds the node's A bound for local rank j anywhere
    and sends A / G to the rank of index j on each of the G - 1 other nodes. The inter-node bytes equal the flat
    all-to-all's, A (G - 1) / G; the intra-node bytes grow from A (n - 1) / P to A (n - 1) / n."""
    n, g = layout.ranks_per_node, layout.nodes
    return AllToAllPlan(n - 1, g - 1, payload * (n - 1) / n, payload * (g - 1) / g)


@dataclass(frozen=True)
class ExpertParallelCost:
    num_tokens: int  # T: tokens of the step over all EP ranks (a decode step: the batch)
    moe_layers: int
    experts_per_rank: float  # E / P
    dispatch_bytes_per_rank: float  # sent by one rank per MoE layer (the same comes back in the combine)
    combine_bytes_per_rank: float
    flat_messages_per_rank: int  # per MoE layer and direction: P - 1
    flat_inter_node_messages_per_rank: int  # P - n
    hierarchical_messages_per_rank: int  # (n - 1) + (G - 1)
    hierarchical_inter_node_messages_per_rank: int  # G - 1
    flat_step_s: float  # dispatch + combine of every MoE layer of the step
    hierarchical_step_s: float


def expert_parallel_cost(
    s: ModelShape, layout: ExpertParallelLayout, num_tokens: int, act_bytes: int = 2
) -> ExpertParallelCost:
    """The all-to-all of one step of `num_tokens` tokens, both ways, flat and hierarchical."""
    if not s.is_moe:
        raise ValueError(f"{s.name} has no experts: expert parallelism needs an MoE model")
    if s.num_experts % layout.expert_parallel_size:
        raise ValueError(
            f"--expert-parallel-size {layout.expert_parallel_size} must divide the {s.num_experts} experts: each rank "
            "holds the same number"
        )
    payload = rank_payload_bytes(s, num_tokens, layout, act_bytes)
    flat, hier = flat_all_to_all(payload, layout), hierarchical_all_to_all(payload, layout)
    sent = flat.intra_bytes + flat.inter_bytes  # to other ranks: A (P - 1) / P
    per_step = 2 * s.moe_layers  # dispatch and combine, every MoE layer
    return ExpertParallelCost(
        num_tokens=num_tokens,
        moe_layers=s.moe_layers,
        experts_per_rank=s.num_experts / layout.expert_parallel_size,
        dispatch_bytes_per_rank=sent,
        combine_bytes_per_rank=sent,
        flat_messages_per_rank=flat.intra_messages + flat.inter_messages,
        flat_inter_node_messages_per_rank=flat.inter_messages,
        hierarchical_messages_per_rank=hier.intra_messages + hier.inter_messages,
        hierarchical_inter_node_messages_per_rank=hier.inter_messages,
        flat_step_s=per_step * flat.time_s(layout),
        hierarchical_step_s=per_step * hier.time_s(layout),
    )
