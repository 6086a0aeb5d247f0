"""AttentionPattern: which cached keys a query reads, for sliding-window models, attention sinks and sparse prefill.

A query at position p (its row's sequence holds seq_len = p + 1 keys) reads
- the window [lo, p], lo = max(0, p + 1 - window): the last `window` keys, itself included (HF's sliding window:
  key j is seen when j > p - window);
- the sinks [0, min(sinks, lo)): the first tokens, always (StreamingLLM; Longformer / BigBird's global tokens);
- with stride > 0, every key j in [sinks, lo) with (p - j) a multiple of stride (Sparse Transformer, strided).
window None is full attention. The native kernel takes a row's pattern as (lo, sinks, stride) (`row_bounds`); the
torch backend as a boolean mask (`allowed`).

Re-based sinks (StreamingLLM's positions within the cache): keys are stored rotated at their own positions, so a
window key's score already depends only on p - j, as in the cache. A sink j sits at distance p - j in the text but
at (sinks + p - lo) - j in the cache; scoring the sinks with the query rotated at p - max(0, lo - sinks)
(`sink_positions`) gives them exactly their cache distance, and the window keys keep theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from leanlm.config.long_context import LongContextConfig


@dataclass(frozen=True)
class AttentionPattern:
    window: int | None = None  # the last `window` keys, the query's own included; None: every key
    sinks: int = 0  # the first `sinks` keys, read by every query
    stride: int = 0  # with a window: every stride-th key before it too (distance a multiple of stride); 0: none
    rebase_sinks: bool = False  # score the sinks at their positions in the cache (just before the window)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"an attention window holds >= 1 keys, got {self.window}")
        if self.sinks < 0 or self.stride < 0:
            raise ValueError(f"sinks and stride must be >= 0, got {self.sinks}, {self.stride}")
        if self.window is None and (self.sinks or self.stride or self.rebase_sinks):
            raise ValueError("sinks and strided keys sit beside a window: give the pattern a window")

    def limited_to(self, window: int | None) -> AttentionPattern:
        """This pattern in a layer trained with its own window: the smaller window wins."""
        if window is None:
            return self
        return dataclasses.replace(self, window=window if self.window is None else min(self.window, window))

    def num_keys(self, seq_len: int) -> int:
        """Keys the last of seq_len tokens reads."""
        if self.window is None or seq_len <= self.window:
            return seq_len
        lo = seq_len - self.window
        sinks = min(self.sinks, lo)
        strided = (
            0
            if not self.stride
            else len(range(seq_len - 1 - ((seq_len - 1 - sinks) // self.stride) * self.stride, lo, self.stride))
        )
        return sinks + strided + self.window


@dataclass(frozen=True)
class StepPatterns:
    """The runtime patterns of one forward, for every layer (each layer narrows them to its own window): one for the
    rows of one-token requests (decodes), one for prompt chunks. None: full attention."""

    decode: AttentionPattern | None = None
    prefill: AttentionPattern | None = None

    @classmethod
    def of(cls, config: LongContextConfig) -> StepPatterns:
        if config.attention_window is not None:
            both = AttentionPattern(config.attention_window, config.attention_sinks, 0, config.attention_sinks > 0)
            return cls(both, both)
        if config.prefill_attention == "local-global":
            return cls(None, AttentionPattern(config.prefill_window, config.prefill_globals))
        if config.prefill_attention == "strided":
            return cls(None, AttentionPattern(config.prefill_window, 0, config.prefill_window))
        return cls()

    @property
    def rebases(self) -> bool:
        return any(p is not None and p.rebase_sinks for p in (self.decode, self.prefill))


def layer_pattern(runtime: AttentionPattern | None, window: int | None) -> AttentionPattern | None:
    """A layer's pattern: the runtime one narrowed to the layer's trained window, or that window alone."""
    if runtime is None:
        return None if window is None else AttentionPattern(window)
    return runtime.limited_to(window)


def row_bounds(seq_lens: torch.Tensor, pattern: AttentionPattern | None) -> torch.Tensor | None:
    """[R] long seq lens -> [R, 3] long (lo, sinks, stride) per row, as the native kernel takes them; None: full."""
    if pattern is None or pattern.window is None:
        return None
    lo = (seq_lens - pattern.window).clamp_(min=0)
    out = torch.empty(seq_lens.shape[0], 3, dtype=torch.long, device=seq_lens.device)
    out[:, 0] = lo
    out[:, 1] = pattern.sinks
    out[:, 2] = pattern.stride
    return out


def sink_positions(seq_lens: torch.Tensor, pattern: AttentionPattern) -> torch.Tensor:
    """[R] long: where each row's query is rotated to score the sinks (its position in the cache)."""
    lo = (seq_lens - pattern.window).clamp(min=0)
    return seq_lens - 1 - (lo - pattern.sinks).clamp_(min=0)


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, pattern: AttentionPattern | None) -> torch.Tensor:
    """[n] query positions x [L] key positions -> [n, L] bool: key readable by the query (causal, then the pattern)."""
    q, k = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
    ok = k <= q
    if pattern is None or pattern.window is None:
        return ok
    lo = (q + 1 - pattern.window).clamp(min=0)
    keep = k >= lo
    if pattern.sinks:
        keep |= k < torch.minimum(lo, torch.full_like(lo, pattern.sinks))
    if pattern.stride:
        keep |= (k < lo) & ((q - k) % pattern.stride == 0)
    return ok & keep


def is_sink(q_pos: torch.Tensor, k_pos: torch.Tensor, pattern: AttentionPattern) -> torch.Tensor:
    """[n, L] bool: the key is read as a sink by the query (scored with the sink query)."""
    lo = (q_pos.unsqueeze(1) + 1 - pattern.window).clamp(min=0)
    return k_pos.unsqueeze(0) < torch.minimum(lo, torch.full_like(lo, pattern.sinks))


def kv_window(patterns: StepPatterns, layer_windows: tuple[int | None, ...], num_layers: int) -> tuple[int, int] | None:
    """(window, sinks) that every layer's queries, decodes and prompt tokens alike, stay within: the KV a sequence
    must keep. None when some layer reads every key (or strided keys reach back to the start)."""
    widest, sinks = 0, 0
    for window in layer_windows or (None,) * num_layers:
        for runtime in (patterns.decode, patterns.prefill):
            pattern = layer_pattern(runtime, window)
            if pattern is None or pattern.window is None or pattern.stride:
                return None
            widest, sinks = max(widest, pattern.window), max(sinks, pattern.sinks)
    return widest, sinks
