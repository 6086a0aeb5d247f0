"""The sparse MLP of a mixture-of-experts layer: a router picks top-k of E experts per token (Shazeer et al. 2017;
Switch, GShard, Mixtral), tokens are grouped per expert so that each expert runs one product over its rows,
and an optional shared expert (Qwen2-MoE, DeepSeek; PR-MoE's dense MLP) runs on every token.

Module and weight names follow HF's Qwen2-MoE / OLMoE: `mlp.gate` (the router), `mlp.experts.{e}.{gate,up,down}_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate`. Every expert is an ordinary SwiGLU MLP of runtime linears, so the
compression loop quantizes, prunes and shards experts through the same units as a dense MLP, and a decode step of
one token reads only its k experts' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.config.model import ModelConfig
from leanlm.config.moe import MoEConfig
from leanlm.kernels import cpu_rows
from leanlm.model.context import ExpertRouting, current_routing
from leanlm.model.experts import GroupedExperts
from leanlm.model.mlp import LlamaMLP


class Router(nn.Module):
    """logits [T, E] = x W^T with W [E, hidden]. Not an nn.Linear: quantizers, pruners and shards leave the router
    in float (llm-compressor and vLLM keep `mlp.gate` unquantized: it is tiny, and its argmax decides everything)."""

    def __init__(self, hidden_size: int, num_experts: int, score_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # DeepSeek-V3: added to the scores when choosing experts, never to their weights
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if score_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts and their weights; `probs` for the load-balancing loss and BPR."""

    experts: torch.Tensor  # [T, k] long, best first
    weights: torch.Tensor  # [T, k] float32
    probs: torch.Tensor  # [T, E] float32: softmax of the router logits (masked experts: 0)


class ExpertLoad:
    """What one MoE layer routed since it was built: counted here on the PyTorch path (plain ints: no device sync of
    their own), and in `native` by the native decode loop ([E + 2] int64: per expert, tokens, experts run)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._load = [0] * num_experts  # assignments each expert ran
        self._tokens = 0  # tokens through the layer
        self.assignments_requested = 0  # tokens x k on the PyTorch path
        self._experts_read = 0  # sum over forwards of the distinct experts run: whose weights were read
        self.native = torch.zeros(num_experts + 2, dtype=torch.int64, device="cpu")  # not meta: models build there

    def add(self, counts: list[int], tokens: int, assignments: int) -> None:
        self._load = [a + b for a, b in zip(self._load, counts, strict=True)]
        self._tokens += tokens
        self.assignments_requested += assignments
        self._experts_read += sum(1 for c in counts if c)

    @property
    def load(self) -> list[int]:
        return [a + b for a, b in zip(self._load, self.native[: self.num_experts].tolist(), strict=True)]

    @property
    def tokens(self) -> int:
        return self._tokens + int(self.native[self.num_experts])

    @property
    def experts_read(self) -> int:
        return self._experts_read + int(self.native[self.num_experts + 1])

    @property
    def assignments(self) -> int:
        """tokens x k: what the router asked for (the native loop never drops: it runs without a capacity)."""
        return self.assignments_requested + int(self.native[: self.num_experts].sum())

    @property
    def dropped(self) -> int:
        """Assignments beyond an expert's capacity (the token kept its residual path)."""
        return self.assignments_requested - sum(self._load)


def route(
    logits: torch.Tensor, moe: MoEConfig, mask: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> Routing:
    """Top-k of softmax(logits [T, E]) (sigmoid for DeepSeek-V3's scorings) in float32 (as HF's routers), weighted by
    `moe.scoring`, chosen among the token's best groups where the experts are grouped, by scores plus `bias` [E]
    where the router has one; `mask` [T, E] bool keeps each token to its allowed experts (static task routing)."""
    logits = logits.float()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    sigmoid = moe.scoring.startswith("sigmoid")
    probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    choice = probs if bias is None else probs + bias.float()
    if moe.num_groups > 1:
        choice = _best_groups(choice, moe, best_two=sigmoid)
    if bias is None and moe.num_groups == 1:
        weights, experts = torch.topk(probs, moe.top_k, dim=-1)
    else:  # chosen on the biased or grouped scores, weighted by the plain ones
        experts = torch.topk(choice, moe.top_k, dim=-1).indices
        weights = probs.gather(1, experts)
    if moe.scoring in ("softmax_renorm", "sigmoid_renorm"):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    elif moe.scoring == "ones":
        weights = torch.ones_like(weights)
    return Routing(experts, weights * moe.routed_scaling_factor, probs)


def _best_groups(scores: torch.Tensor, moe: MoEConfig, best_two: bool) -> torch.Tensor:
    """scores [T, E] with the experts outside each token's topk_groups best groups masked out (DeepSeek's
    group-limited routing: a group scores its best expert, or with `best_two` its best two's sum)."""
    grouped = scores.view(scores.shape[0], moe.num_groups, -1)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if best_two else grouped.max(dim=-1).values  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group_scores, moe.topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)


def capacity_keep(
    experts: torch.Tensor, capacity: int, num_experts: int, priority: torch.Tensor | None
) -> torch.Tensor:
    """keep [T, k] bool: which assignments fit `capacity` rows per expert. Capacity goes to every token's first
    choice before any second choice (GShard); within a choice rank, in token order, or by descending `priority` [T]
    (batch priority routing: the router's top probability, V-MoE)."""
    num_tokens, k = experts.shape
    order = (
        torch.arange(num_tokens, device=experts.device)
        if priority is None
        else torch.argsort(priority, descending=True, stable=True)
    )
    ordered = experts[order].T.reshape(-1)  # [k*T]: choice rank major, then token priority
    hits = F.one_hot(ordered, num_experts)  # [k*T, E]
    position = (hits.cumsum(0) * hits).sum(1) - 1  # each assignment's place in its expert's queue
    keep = torch.empty(k, num_tokens, dtype=torch.bool, device=experts.device)
    keep[:, order] = (position < capacity).view(k, num_tokens)
    return keep.T


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss E * sum_e f_e * P_e over probs [T, E] and experts [T, k]: f_e the share of
    assignments expert e got, P_e its mean router probability; 1.0 when routing is uniform."""
    num_experts = probs.shape[-1]
    share = F.one_hot(experts.reshape(-1), num_experts).float().mean(0)  # [E]
    return num_experts * (share * probs.mean(0)).sum()


class SparseMoeBlock(nn.Module):
    """x [T, hidden] -> sum over its k experts of weight * expert(x), plus the shared expert (gated or not)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        hidden = config.hidden_size
        self.gate = Router(hidden, moe.num_experts, moe.score_bias)
        self.experts = nn.ModuleList(LlamaMLP(hidden, moe.expert_intermediate_size) for _ in range(moe.num_experts))
        self.shared_expert = (
            LlamaMLP(hidden, moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = Router(hidden, 1) if moe.shared_expert_gate else None
        self.stats = ExpertLoad(moe.num_experts)
        self.last_routing: Routing | None = None  # kept while autograd records: the trainer's balancing loss reads it
        self.grouped = GroupedExperts()  # the experts' grouped forms (experts.py), made from self.experts on use

    def forward(self, x: torch.Tensor, routing: ExpertRouting | None = None) -> torch.Tensor:  # [T, hidden]
        """`routing`: the engine's options for this call; None: the forward context's (the plain default outside
        one)."""
        out = self.dispatch(x, *self.choose(x, routing))
        shared = self.shared_output(x)
        return out if shared is None else out + shared

    def choose(
        self, x: torch.Tensor, routing: ExpertRouting | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each row's experts [T, k] and weights [T, k] float32, and which assignments fit the routing policy's
        capacity ([T, k] bool; None: every one), under its expert mask; `routing` None: the forward context's."""
        routing = current_routing(x.shape[0]) if routing is None else routing
        mask, policy = routing.mask, routing.policy
        capacity = policy.capacity(x.shape[0], self.moe.top_k, self.moe.num_experts)
        if mask is None and capacity is None and self.moe.is_plain and self.native_routing(x):
            # bf16 CPU rows: the native decode loop's routing, so a step's bits do not depend on which path ran it
            return (*cpu_rows.moe_route(x, self.gate.weight, self.moe.top_k, self.moe.scoring), None)
        routed = route(self.gate(x), self.moe, mask, getattr(self.gate, "e_score_correction_bias", None))
        self.last_routing = routed if torch.is_grad_enabled() else None
        if capacity is None:
            return routed.experts, routed.weights, None
        priority = routed.probs.max(dim=-1).values if policy.batch_priority else None
        keep = capacity_keep(routed.experts, capacity, self.moe.num_experts, priority)
        return routed.experts, routed.weights, keep

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's rows [T, hidden] (gated where the model gates it); None without one."""
        if self.shared_expert is None:
            return None
        shared = self.shared_expert(x)
        return shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared

    def native_routing(self, x: torch.Tensor) -> bool:
        """bf16 CPU rows autograd need not see (the kernel has no backward): the native loop's routing."""
        if not isinstance(self.gate, Router):  # a stand-in router (MoEfication's oracle) routes its own way
            return False
        grad = torch.is_grad_enabled() and (self.gate.weight.requires_grad or x.requires_grad)
        return not grad and cpu_rows.can_route(x, self.gate.weight)

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """Group the kept (token, expert) assignments by expert and run them as one grouped product (experts.py:
        each expert once over its rows, on its format's kernels); the weighted rows are added back to their tokens
        in ascending expert order."""
        num_tokens, k = experts.shape
        flat_experts, flat_weights = experts.reshape(-1), weights.reshape(-1)  # [T*k]
        flat_tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(k)
        if keep is not None:
            kept = keep.reshape(-1)
            flat_experts, flat_weights, flat_tokens = flat_experts[kept], flat_weights[kept], flat_tokens[kept]
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.moe.num_experts).tolist()
        rows, row_weights = flat_tokens[order], flat_weights[order]  # [A]
        y = self.grouped.forward(self.experts, x[rows], counts)  # [A, hidden], expert by expert
        out = torch.zeros_like(x)
        out.index_add_(0, rows, (y * row_weights[:, None]).to(x.dtype))  # in row order: ascending expert
        self.stats.add(counts, num_tokens, num_tokens * k)
        return out


@dataclass(frozen=True)
class MoEStats:
    """What the MoE layers of a model routed since the engine started (EngineStats.moe)."""

    expert_load: tuple[tuple[int, ...], ...]  # [MoE layer][expert]: assignments run
    tokens: int  # tokens through the model's first MoE layer
    assignments: int  # tokens x k, summed over MoE layers
    dropped: int  # assignments beyond an expert's capacity, summed over MoE layers
    expert_bytes_per_token: float  # weight bytes of the experts run per token (distinct experts a forward read)
    dense_weight_bytes: int  # every other weight read per step: attention, norms, routers, shared experts, head

    @property
    def drop_rate(self) -> float:
        return self.dropped / self.assignments if self.assignments else 0.0

    @property
    def weight_bytes_per_token(self) -> float:
        """Weight bytes read per token at the batch sizes seen: the dense part once per token plus the experts."""
        return self.dense_weight_bytes + self.expert_bytes_per_token


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def module_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers (packed runtime formats: their stored codes and scales)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True)
class MoESizes:
    """Weight bytes a model's MoE counters are read against, measured once (walking every tensor per step would
    cost a batch-1 step some of its time)."""

    expert_bytes: tuple[int, ...]  # one expert of each MoE layer (a layer's experts share one shape and format)
    dense_weight_bytes: int  # every weight but the experts and an untied embedding table (a step reads its rows)

    @classmethod
    def of(cls, model: nn.Module) -> MoESizes | None:
        blocks = moe_blocks(model)
        if not blocks:
            return None
        # a pipeline stage may hold neither (leanlm.parallel.pipeline.cut_stage)
        embed, head = getattr(model.model, "embed_tokens", None), getattr(model, "lm_head", None)
        tied = embed is not None and head is not None and any(p is embed.weight for p in head.parameters())
        experts = sum(module_bytes(b.experts) for b in blocks)
        dense = module_bytes(model) - experts - (0 if tied or embed is None else module_bytes(embed))
        return cls(tuple(module_bytes(_local_expert(b)) for b in blocks), dense)


def _local_expert(block: SparseMoeBlock) -> nn.Module:
    """An expert this process holds (under expert parallelism the others are placeholders without weights)."""
    return max(block.experts, key=module_bytes)


def moe_stats(model: nn.Module, sizes: MoESizes | None = None) -> MoEStats | None:
    """The model's MoE counters (None for a dense model), against `sizes` (measured now when not given)."""
    blocks = moe_blocks(model)
    sizes = sizes if sizes is not None else MoESizes.of(model)
    if not blocks or sizes is None:
        return None
    tokens = blocks[0].stats.tokens
    expert_read = sum(b.stats.experts_read * n for b, n in zip(blocks, sizes.expert_bytes, strict=True))
    return MoEStats(
        expert_load=tuple(tuple(b.stats.load) for b in blocks),
        tokens=tokens,
        assignments=sum(b.stats.assignments for b in blocks),
        dropped=sum(b.stats.dropped for b in blocks),
        expert_bytes_per_token=expert_read / tokens if tokens else 0.0,
        dense_weight_bytes=sizes.dense_weight_bytes,
    )
