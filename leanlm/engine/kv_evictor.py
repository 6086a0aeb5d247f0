"""KVEvictor: the model runner's side of a KV budget. It watches the queries of budgeted requests during each
forward (H2O: every query's attention accumulated per cached slot; SnapKV: the last queries kept for the next
selection) and carries out the scheduler's Compactions on the KV tensors (leanlm.model.kv_eviction's math).

Watching a request takes the per-layer path (the native all-decode loop returns no queries) and, per layer, one
softmax of its new queries over its kept slots in float32: O(new tokens x kept slots x heads x D) per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from leanlm.engine.kv_budget import Compaction, KVBudget
from leanlm.engine.outputs import SchedulerOutput
from leanlm.model import kv_eviction
from leanlm.model.context import ForwardContext
from leanlm.model.paged_kv import LayerKV, PagedKVCache


@dataclass
class _Watched:
    """One budgeted request's rows in this step's batch."""

    request_id: str
    row_start: int  # its new tokens are batch rows [row_start, row_start + num_rows)
    num_rows: int
    first_slot: int  # the slot of its first new token: its KV tokens before the step
    rows: torch.Tensor  # [Hkv, S] long: its slots' cache rows, S = first_slot + num_rows (kv_eviction.slot_rows)


@dataclass
class _Scores:
    """What a budgeted request's next selection reads, per layer."""

    attention: torch.Tensor | None  # H2O: [L, Hkv, capacity] float32, slots [0, num_slots) valid
    window: torch.Tensor | None  # SnapKV: [L, w, H, D] its last queries, the last num_window rows valid
    num_slots: int = 0
    num_window: int = 0


class KVEvictor:
    def __init__(self, budget: KVBudget, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:  # fmt: skip
        self.budget = budget
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5  # the model's attention scale (LlamaAttention.scale)
        self.device = device
        self._scores: dict[str, _Scores] = {}
        self._watched: list[_Watched] = []  # this step's

    def start_step(self, so: SchedulerOutput) -> None:
        """Note the budgeted requests of this step whose queries the forward must show: every step for H2O, for
        SnapKV once its window may reach the next selection. Finished requests are forgotten; a request starting
        from no KV (new, or recomputed after a preemption) starts from no scores."""
        for request_id in so.finished_request_ids:
            self._scores.pop(request_id, None)
        self._watched = []
        row_start = 0
        for request, num_new, block_ids in zip(so.scheduled_requests, so.num_scheduled_tokens, so.block_ids):
            first_slot = request.num_kv_tokens
            if self.budget.applies_to(request):
                if first_slot == 0:
                    self._scores.pop(request.request_id, None)
                if self._needs_queries(first_slot + num_new):
                    self._watch(request.request_id, row_start, num_new, first_slot, block_ids)
            row_start += num_new

    def _watch(self, request_id: str, row_start: int, num_new: int, first_slot: int, block_ids: list[int]) -> None:
        if request_id not in self._scores:
            self._scores[request_id] = self._empty_scores()
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows = kv_eviction.slot_rows(ids, self.num_kv_heads, self.budget.block_size, first_slot + num_new)
        self._watched.append(_Watched(request_id, row_start, num_new, first_slot, rows))

    def attach(self, ctx: ForwardContext) -> ForwardContext:
        """The step's forward context with this evictor watching the queries, when a budgeted request needs it."""
        return dataclasses.replace(ctx, query_observer=self.observe) if self._watched else ctx

    def observe(self, layer_idx: int, q: torch.Tensor, kv: LayerKV) -> None:
        """Called by each attention layer once its new K/V are in the cache: q [T, H, D] with rotary applied."""
        for watched in self._watched:
            scores = self._scores[watched.request_id]
            queries = q[watched.row_start : watched.row_start + watched.num_rows]
            if scores.attention is not None:  # H2O
                keys = kv_eviction.gather_keys(kv.k_cache, kv.k_scales, watched.rows)  # [Hkv, S, D]
                gain = kv_eviction.accumulated_attention(queries, keys, self.scale, watched.first_slot)
                scores.attention = _grown(scores.attention, gain.shape[-1])
                scores.attention[layer_idx, :, : gain.shape[-1]] += gain
            else:  # SnapKV: a rolling window of the last queries
                size = scores.window.shape[1]
                scores.window[layer_idx] = torch.cat([scores.window[layer_idx], queries[-size:].float()])[-size:]
            if layer_idx == self.num_layers - 1:  # the last layer: the step's queries are all in
                scores.num_slots = watched.first_slot + watched.num_rows
                scores.num_window = min(scores.num_window + watched.num_rows, self.budget.snapkv_window)

    def compact(self, compactions: list[Compaction], kv_cache: PagedKVCache) -> None:
        """Carry out the scheduler's evictions, before anything else of the step touches the cache: per layer and
        KV head, pick the kept slots by the policy and gather them to the request's first slots."""
        for compaction in compactions:
            scores = self._scores.get(compaction.request_id)
            if scores is None or scores.num_slots != compaction.num_kv_tokens:
                raise RuntimeError(
                    f"request {compaction.request_id!r}: the evictor scored {scores and scores.num_slots} KV slots, "
                    f"the scheduler evicts from {compaction.num_kv_tokens}"
                )
            ids = torch.tensor(compaction.block_ids, dtype=torch.long, device=self.device)
            rows = kv_eviction.slot_rows(ids, kv_cache.num_kv_heads, kv_cache.block_size, compaction.num_kv_tokens)
            kept = compaction.num_kept_tokens
            for layer_idx in range(self.num_layers):
                layer = kv_cache.layer(layer_idx)
                keep = self._keep(scores, layer_idx, layer, rows, kept)  # [Hkv, kept]
                for tensor in layer:
                    if tensor is not None:
                        kv_eviction.compact(tensor, rows, keep)
                if scores.attention is not None:
                    scores.attention[layer_idx, :, :kept] = scores.attention[layer_idx].gather(1, keep)
            scores.num_slots = kept
            if scores.attention is not None:
                scores.attention[:, :, kept:] = 0

    def _keep(self, scores: _Scores, layer_idx: int, layer: LayerKV, rows: torch.Tensor, kept: int) -> torch.Tensor:
        """[Hkv, kept] ascending slots of this layer to keep."""
        num_slots = rows.shape[1]
        if scores.attention is not None:
            return kv_eviction.h2o_keep(scores.attention[layer_idx, :, :num_slots], kept)
        window = scores.num_window
        keys = kv_eviction.gather_keys(layer.k_cache, layer.k_scales, rows)
        queries = scores.window[layer_idx, scores.window.shape[1] - window :]  # those of the last `window` slots
        probs = kv_eviction.attention_probs(queries, keys, self.scale, num_slots - window)
        return kv_eviction.snapkv_keep(probs, kept)

    def _needs_queries(self, num_kv_after: int) -> bool:
        """H2O scores every query; SnapKV reads only the last window before a selection, which comes once a
        request holds more than the budget."""
        return self.budget.policy == "h2o" or num_kv_after + self.budget.snapkv_window > self.budget.num_tokens

    def _empty_scores(self) -> _Scores:
        if self.budget.policy == "h2o":
            attention = torch.zeros(self.num_layers, self.num_kv_heads, 0, device=self.device)
            return _Scores(attention=attention, window=None)
        shape = (self.num_layers, self.budget.snapkv_window, self.num_heads, self.head_dim)
        return _Scores(attention=None, window=torch.zeros(shape, device=self.device))


def _grown(attention: torch.Tensor, num_slots: int) -> torch.Tensor:
    """H2O's [L, Hkv, capacity] scores with room for num_slots slots: doubled (zero-filled) when short."""
    if attention.shape[-1] >= num_slots:
        return attention
    grown = attention.new_zeros(*attention.shape[:2], max(num_slots, 2 * attention.shape[-1]))
    grown[..., : attention.shape[-1]] = attention
    return grown
