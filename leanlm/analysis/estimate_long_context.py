"""What bounded attention saves on long inputs (pure functions over a ModelShape): the KV-cache bytes of one
sequence and the attention FLOPs of one decoded token and of a whole prefill, under full attention, under a
window of W keys plus S sinks (StreamingLLM, Xiao et al. 2023), and under a KV budget of N cached tokens (H2O,
Zhang et al. 2023; SnapKV, Li et al. 2024).

A window bounds both phases: a query reads at most W + S keys, so decode costs O(W) and prefill O(ctx * W). A KV
budget bounds only what stays cached: the prompt is attended in full before anything is evicted (SnapKV chooses
from the prompt's own attention, H2O accumulates it), so prefill stays O(ctx^2); decodes then read N keys.
The weights' matmuls (estimate.matmul_flops_per_token) are the same under all three and are not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.analysis import estimate as est
from leanlm.analysis.model_shape import ModelShape

LONG_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)  # 4k .. 128k tokens


@dataclass(frozen=True)
class BoundedAttention:
    """The bounded options to compare with full attention; the window and the budget are two alternatives."""

    window: int | None = None  # W: the last W tokens each query reads
    sinks: int = 0  # S: the first S tokens each query reads besides the window
    kv_budget: int | None = None  # N: most cached tokens per sequence

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"--attention-window must be >= 1 tokens, got {self.window}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError(f"--kv-budget must be >= 1 tokens, got {self.kv_budget}")
        if self.sinks < 0:
            raise ValueError(f"--attention-sinks must be >= 0 tokens, got {self.sinks}")
        if self.sinks and self.window is None:
            raise ValueError("--attention-sinks keep the first tokens beside a window: set --attention-window too")

    @property
    def any(self) -> bool:
        return self.window is not None or self.kv_budget is not None


@dataclass(frozen=True)
class AttentionCost:
    """One sequence at `context` tokens under one kind of attention."""

    cached_tokens: int  # K/V rows kept per layer
    kv_bytes: float  # cached_tokens * estimate.kv_bytes_per_token
    decode_keys: int  # keys the token at position `context` reads (itself included)
    decode_flops: float  # QK^T and AV of that token, all layers
    prefill_flops: float  # QK^T and AV of a causal prefill of `context` tokens, all layers


@dataclass(frozen=True)
class LongContextRow:
    context: int
    full: AttentionCost
    window: AttentionCost | None  # None when no window was asked for
    budget: AttentionCost | None  # None when no budget was asked for


def window_keys(context: int, window: int, sinks: int = 0) -> int:
    """Keys one query at `context` reads with a window and sinks: min(context, W + S)."""
    return min(context, window + sinks)


def prefill_key_reads(prompt_len: int, keys: int | None = None) -> int:
    """Sum over the prompt's positions i = 1..n of the keys query i reads, min(i, keys): n(n+1)/2 unbounded,
    K(K+1)/2 + (n - K) K with a bound K < n."""
    n = prompt_len
    if keys is None or keys >= n:
        return n * (n + 1) // 2
    return keys * (keys + 1) // 2 + (n - keys) * keys


def prefill_attention_flops(s: ModelShape, prompt_len: int, keys: int | None = None) -> float:
    """QK^T and AV of a causal prefill, 4 L H D per (query, key) pair: the attention term of estimate.prefill_flops
    when `keys` is None."""
    return 4 * s.num_hidden_layers * s.attention_width * prefill_key_reads(prompt_len, keys)


def _cost(s: ModelShape, kv: est.NumberFormat, kept: int, context: int, prefill_keys: int | None) -> AttentionCost:
    """`kept` tokens cached and read by each decode; a prefill of `context` tokens reading at most `prefill_keys`
    keys a query (None: every earlier one)."""
    return AttentionCost(
        cached_tokens=kept,
        kv_bytes=kept * est.kv_bytes_per_token(s, kv),
        decode_keys=kept,
        decode_flops=est.attention_flops_per_token(s, kept),
        prefill_flops=prefill_attention_flops(s, context, prefill_keys),
    )


def full_cost(s: ModelShape, kv: est.NumberFormat, context: int) -> AttentionCost:
    return _cost(s, kv, context, context, None)


def window_cost(s: ModelShape, kv: est.NumberFormat, context: int, window: int, sinks: int = 0) -> AttentionCost:
    """Every query, prompt or decode, reads the sinks and the last W tokens; only those stay cached."""
    return _cost(s, kv, window_keys(context, window, sinks), context, window + sinks)


def budget_cost(s: ModelShape, kv: est.NumberFormat, context: int, budget: int) -> AttentionCost:
    """At most N tokens stay cached and decodes read them; the prefill still attends to the whole prompt."""
    return _cost(s, kv, min(context, budget), context, None)


def long_contexts(max_context: int | None = None) -> list[int]:
    """4k .. 128k tokens, and the model's own context when it is not among them."""
    return sorted({*LONG_CONTEXTS, *([max_context] if max_context else [])})


def long_context_rows(
    s: ModelShape, kv: est.NumberFormat, bound: BoundedAttention, contexts: list[int]
) -> list[LongContextRow]:
    return [
        LongContextRow(
            context=n,
            full=full_cost(s, kv, n),
            window=None if bound.window is None else window_cost(s, kv, n, bound.window, bound.sinks),
            budget=None if bound.kv_budget is None else budget_cost(s, kv, n, bound.kv_budget),
        )
        for n in contexts
    ]
