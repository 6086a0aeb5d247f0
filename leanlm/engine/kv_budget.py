"""KVBudget: which requests keep at most N tokens of KV, and when one is compacted back to N (the scheduler's plain
ints); Compaction: one such eviction, which the model runner carries out on the KV tensors (engine/kv_evictor.py).

A budgeted request's slots (`Request.num_kv_tokens`) stop following its positions: after an eviction its kept
tokens sit in its first slots and new tokens are written after them, while positions go on counting. Compactions
are amortized: a request is compacted when it holds more than budget + block_size tokens, so one gather per block
of new tokens, never one per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.config.long_context import KV_EVICTION_POLICIES, LongContextConfig
from leanlm.engine.request import Request
from leanlm.model.kv_eviction import SNAPKV_WINDOW


@dataclass(frozen=True)
class KVBudget:
    num_tokens: int  # most KV tokens a budgeted request keeps after a compaction
    policy: str  # 'h2o' | 'snapkv' (leanlm.model.kv_eviction)
    block_size: int  # tokens per KV block: a request may hold this many more before it is compacted

    def __post_init__(self) -> None:
        if self.num_tokens < 2:
            raise ValueError(f"a KV budget keeps recent and selected tokens: give at least 2, got {self.num_tokens}")
        if self.policy not in KV_EVICTION_POLICIES:
            raise ValueError(f"kv_eviction must be one of {', '.join(KV_EVICTION_POLICIES)}, got {self.policy!r}")

    @classmethod
    def of(cls, config: LongContextConfig, block_size: int) -> KVBudget | None:
        """The engine's budget, or None without --kv-budget."""
        if config.kv_budget is None:
            return None
        return cls(config.kv_budget, config.kv_eviction, block_size)

    @property
    def snapkv_window(self) -> int:
        """SnapKV's observation window: the paper's 32 queries, at most half the budget."""
        return min(SNAPKV_WINDOW, self.num_tokens // 2)

    def applies_to(self, request: Request) -> bool:
        """A request whose prompt and max_tokens fit the budget is never touched: no scoring, no eviction, prefix
        caching as usual."""
        return request.num_prompt_tokens + request.sampling_params.max_tokens > self.num_tokens

    def is_over(self, request: Request) -> bool:
        """The request holds more than budget + block_size KV tokens: compact it before its next tokens."""
        return self.applies_to(request) and request.num_kv_tokens > self.num_tokens + self.block_size


@dataclass(frozen=True)
class Compaction:
    """One eviction the runner carries out before the step's forward (and before swaps and copies): the kept
    tokens move to the request's first `num_kept_tokens` slots, per layer and KV head."""

    request_id: str
    block_ids: list[int]  # the request's blocks before the eviction: the kept tokens may sit in any of them
    num_kv_tokens: int  # slots in use before
    num_kept_tokens: int  # slots in use after (the budget); the blocks past them are back in the pool
