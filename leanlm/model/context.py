"""ForwardContext: the flat batch metadata and the KV cache attention layers read during one forward, and the
engine's per-step options in small typed parts, one per concern (expert routing, long-input patterns, LoRA, KV
scoring).

Set by the model runner through `forward_context(ctx)`, which refuses nesting; the model never sees a Request and
holds no cache and no engine option of its own: two engines can share one model.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from leanlm.config.moe import RoutingPolicy
from leanlm.model.attention_pattern import AttentionPattern, StepPatterns, row_bounds, sink_positions
from leanlm.model.lora import LoRAMapping
from leanlm.model.paged_kv import LayerKV, PagedKVCache


@dataclass(frozen=True)
class PrefillSpan:
    """One request with several new tokens (a prompt chunk): attention runs on it alone."""

    token_start: int  # its tokens are rows [token_start, token_end) of the batch
    token_end: int
    seq_len: int  # tokens with KV after this step; the new ones are the last (token_end - token_start)
    block_ids: torch.Tensor  # [num_blocks] long, covering seq_len tokens


@dataclass(frozen=True)
class ExpertRouting:
    """How the MoE layers route in this forward (leanlm.model.moe); the default routes every token to its top-k."""

    policy: RoutingPolicy = RoutingPolicy()  # the engine's expert capacity and batch priority (EngineConfig)
    # [T, E] bool: the experts each token may use (static task routing: requests that pin an expert subset); None: all
    mask: torch.Tensor | None = None

    @property
    def is_plain(self) -> bool:
        """No mask and no capacity: what the native decode loop routes."""
        return self.mask is None and self.policy.capacity_factor is None


@dataclass(frozen=True)
class LongInputs:
    """Long inputs (leanlm.model.attention_pattern): the runtime patterns every layer narrows to its trained window;
    with re-based sinks, each row's sink position and the sinks' query rotation."""

    patterns: StepPatterns = StepPatterns()
    sink_positions: torch.Tensor | None = None  # [T] long
    sink_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) [T, 1, D/2], the model's dtype


@dataclass(frozen=True)
class ForwardContext:
    """Batch layout of one forward over B requests and T = sum of their scheduled tokens."""

    kv_cache: PagedKVCache  # where every layer reads and writes K/V in this forward (owned by the caller)
    slot_mapping: torch.Tensor  # [T] long: cache slot (block_id * block_size + offset) for each new token
    # [T * Hkv] long: row of token t, head h in a cache viewed as [N * Hkv * bs, D] (blocks are [Hkv, bs, D])
    kv_write_index: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] long: each request's KV block ids, padded with 0
    query_start_loc: torch.Tensor  # [B+1] long: request i's tokens are rows [qsl[i], qsl[i+1]) of the batch
    seq_lens: torch.Tensor  # [B] long: tokens with KV after this step (computed before + scheduled now)
    block_size: int
    is_all_decode: bool  # every request has one new token: attention needs no row gather/scatter
    # The batch split for attention: one-token requests (decodes) run batched, the rest one by one.
    decode_token_idx: torch.Tensor  # [Bd] long: batch rows of the one-token requests
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] long
    decode_seq_lens: torch.Tensor  # [Bd] long
    decode_max_seq_len: int  # 0 when there is no decode
    prefills: tuple[PrefillSpan, ...]
    routing: ExpertRouting = ExpertRouting()  # MoE layers: capacity, batch priority, pinned experts
    long_inputs: LongInputs = LongInputs()  # attention windows, sinks and prefill patterns
    _bounds: dict = field(default_factory=dict, repr=False, compare=False)  # row_bounds per pattern pair, per step
    # (layer_idx, q [T, H, D] with rotary, the layer's LayerKV) after each attention layer stored its new K/V: a KV
    # budget's scoring (engine/kv_evictor.py). Set, it keeps the step off the native all-decode loop. None: off
    query_observer: Callable[[int, torch.Tensor, LayerKV], None] | None = None
    # LoRA adapters (leanlm.model.lora): each row's adapter slot and the engine's stacked adapters. Set, it keeps the
    # step off the native all-decode loop. None: every row runs the base model
    lora: LoRAMapping | None = None

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    @functools.cached_property
    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every batch row as a one-query request: (block tables [T, max_blocks] long, the row's request's table;
        seq lens [T] long, its position + 1; the longest). Built once per step, on first use."""
        query_lens = self.query_start_loc.diff()  # [B]
        tables = self.block_tables.repeat_interleave(query_lens, dim=0)
        ends = self.seq_lens.repeat_interleave(query_lens)  # each row's request's seq_len
        after = self.query_start_loc[1:].repeat_interleave(query_lens) - torch.arange(
            tables.shape[0], device=tables.device
        )  # rows of its request after this one, itself included
        seq_lens = ends - after + 1
        return tables, seq_lens, int(self.seq_lens.max())

    def decode_bounds(self, pattern: AttentionPattern | None) -> torch.Tensor | None:
        """[Bd, 3] long (lo, sinks, stride) of the decode rows under `pattern`; None: every key."""
        key = ("decode", pattern)
        if key not in self._bounds:
            self._bounds[key] = row_bounds(self.decode_seq_lens, pattern)
        return self._bounds[key]

    def token_bounds(self, decode: AttentionPattern | None, prefill: AttentionPattern | None) -> torch.Tensor | None:
        """[T, 3] long (lo, sinks, stride) of every batch row (token_rows' order): a decode's under `decode`, a prompt
        token's under `prefill`; None: every row reads every key."""
        key = ("tokens", decode, prefill)
        if key not in self._bounds:
            self._bounds[key] = self._token_bounds(decode, prefill)
        return self._bounds[key]

    def _token_bounds(self, decode: AttentionPattern | None, prefill: AttentionPattern | None) -> torch.Tensor | None:
        if decode is None and prefill is None:
            return None
        seq_lens = self.token_rows[1]
        num_rows = seq_lens.shape[0]
        out = torch.zeros(num_rows, 3, dtype=torch.long, device=seq_lens.device)  # lo 0: every key
        is_prompt = torch.zeros(num_rows, dtype=torch.bool, device=seq_lens.device)
        for span in self.prefills:
            is_prompt[span.token_start : span.token_end] = True
        for pattern, rows in ((decode, ~is_prompt), (prefill, is_prompt)):
            bounds = row_bounds(seq_lens, pattern)
            if bounds is not None:
                out[rows] = bounds[rows]
        return out


_state = threading.local()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` visible to attention layers for the duration of one forward (per thread, not nestable)."""
    if getattr(_state, "ctx", None) is not None:
        raise RuntimeError("forward_context is already set: one forward at a time per thread")
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = None


def get_forward_context() -> ForwardContext:
    ctx = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError("no forward context: run the model through ModelRunner (or inside forward_context)")
    return ctx


def current_routing(num_tokens: int) -> ExpertRouting:
    """The forward context's expert routing for a batch of `num_tokens` rows; the plain default outside a forward
    (training, calibration)."""
    ctx = getattr(_state, "ctx", None)
    routing = ExpertRouting() if ctx is None else ctx.routing
    if routing.mask is not None and routing.mask.shape[0] != num_tokens:
        raise RuntimeError(f"the expert mask covers {routing.mask.shape[0]} tokens, the forward {num_tokens}")
    return routing


def current_lora() -> LoRAMapping | None:
    """The forward context's LoRA mapping; None outside a forward (training, calibration) or in a base-only batch."""
    ctx = getattr(_state, "ctx", None)
    return None if ctx is None else ctx.lora


def build_forward_context(
    query_lens: list[int],
    seq_lens: list[int],
    block_ids: list[list[int]],
    kv_cache: PagedKVCache,
    patterns: StepPatterns = StepPatterns(),
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    routing: ExpertRouting = ExpertRouting(),
) -> ForwardContext:
    """Lay out B requests' metadata: query_lens[i] new tokens ending at seq_lens[i], KV in block_ids[i] of
    `kv_cache` (whose block size, KV heads and device the layout follows). With runtime attention `patterns` that
    re-base sinks, `rotary(positions)` gives the sinks' query rotation (cos, sin) for each row."""
    block_size, num_kv_heads, device = kv_cache.block_size, kv_cache.num_kv_heads, kv_cache.device
    num_reqs = len(query_lens)
    max_blocks = max(len(b) for b in block_ids)
    table = [b + [0] * (max_blocks - len(b)) for b in block_ids]
    qsl = [0]
    slots: list[int] = []
    for q_len, s_len, blocks in zip(query_lens, seq_lens, block_ids):
        qsl.append(qsl[-1] + q_len)
        for pos in range(s_len - q_len, s_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    decode_rows = [i for i in range(num_reqs) if query_lens[i] == 1]
    decode_seq = [seq_lens[i] for i in decode_rows]
    prefills = tuple(
        PrefillSpan(qsl[i], qsl[i + 1], seq_lens[i], torch.tensor(block_ids[i], dtype=torch.long, device=device))
        for i in range(num_reqs)
        if query_lens[i] > 1
    )

    def as_tensor(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    decode_table = [table[i] for i in decode_rows]
    slot_mapping = as_tensor(slots)
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    heads = torch.arange(num_kv_heads, device=device)
    kv_write_index = ((block[:, None] * num_kv_heads + heads) * block_size + offset[:, None]).reshape(-1)
    return ForwardContext(
        kv_cache=kv_cache,
        routing=routing,
        slot_mapping=slot_mapping,
        kv_write_index=kv_write_index,
        is_all_decode=len(decode_rows) == num_reqs,
        block_tables=as_tensor(table),
        query_start_loc=as_tensor(qsl),
        seq_lens=as_tensor(seq_lens),
        block_size=block_size,
        decode_token_idx=as_tensor([qsl[i] for i in decode_rows]),
        decode_block_tables=as_tensor(decode_table)
        if decode_table
        else torch.zeros(0, max_blocks, dtype=torch.long, device=device),
        decode_seq_lens=as_tensor(decode_seq),
        decode_max_seq_len=max(decode_seq, default=0),
        prefills=prefills,
        long_inputs=_long_inputs(query_lens, seq_lens, patterns, rotary, device),
    )


def _long_inputs(query_lens: list[int], seq_lens: list[int], patterns: StepPatterns, rotary, device) -> LongInputs:
    """The step's patterns, with sink positions and rotation where they re-base sinks (one pattern for every row)."""
    if not patterns.rebases:
        return LongInputs(patterns)
    if rotary is None:
        raise ValueError("attention sinks are re-based through the model's rotary table: pass rotary=")
    row_lens = torch.tensor([s - q + 1 + i for q, s in zip(query_lens, seq_lens) for i in range(q)], dtype=torch.long)
    positions = sink_positions(row_lens, patterns.decode).to(device)
    return LongInputs(patterns, positions, rotary(positions))
