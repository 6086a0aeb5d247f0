"""LongContextConfig: which cached keys attention reads on long inputs, and how much KV a sequence may keep.

Three independent choices, each off by default:
- a window with attention sinks for every row (StreamingLLM, Xiao et al. 2023): keep the first `attention_sinks`
  tokens and the last `attention_window`; KV blocks between them are freed, so memory stays bounded and generation
  may go on past the model's context;
- a fixed sparse pattern for prompt tokens only (Longformer / BigBird local + global, Sparse Transformer strided);
- a KV budget per sequence (H2O heavy hitters, SnapKV's selection by the prompt's last queries), evicting single
  tokens' K/V and reusing their slots.

A model trained with a sliding window (Mistral, Qwen2 `use_sliding_window`, `layer_types`) needs none of these: its
windows come from its config (ModelConfig.layer_windows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PREFILL_PATTERNS = ("full", "local-global", "strided")
KV_EVICTION_POLICIES = ("h2o", "snapkv")
STREAMING_CONTEXT = 1 << 20  # the context limit while a window bounds attention (positions past the model's own)


@dataclass(frozen=True)
class LongContextConfig:
    """Each field is a CLI flag of the commands that load a model (and an LLM keyword argument)."""

    attention_window: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "every query reads only the last N cached tokens (plus --attention-sinks); blocks that leave the "
            "window are freed, so KV memory stays bounded and generation may run past the model's context "
            "(default: full attention)"
        },
    )
    attention_sinks: int = dataclasses.field(
        default=0,
        metadata={
            "help": "with --attention-window: the first N tokens stay readable by every query, at positions re-based "
            "to sit just before the window (StreamingLLM's attention sinks; 4 is the paper's choice)"
        },
    )
    prefill_attention: str = dataclasses.field(
        default="full",
        metadata={
            "choices": PREFILL_PATTERNS,
            "help": "prompt tokens read a sparse subset of their prefix: local-global (the last --prefill-window "
            "tokens plus the first --prefill-globals, Longformer / BigBird) | strided (the last --prefill-window "
            "plus every --prefill-window-th token before them, Sparse Transformer); decodes stay full",
        },
    )
    prefill_window: int = dataclasses.field(
        default=1024, metadata={"help": "the local window (and stride) of --prefill-attention"}
    )
    prefill_globals: int = dataclasses.field(
        default=64, metadata={"help": "global tokens (the prompt's first) of --prefill-attention local-global"}
    )
    kv_budget: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "most cached tokens per sequence and KV head; beyond it the least attended are evicted and "
            "their slots reused (--kv-eviction); default: no budget"
        },
    )
    kv_eviction: str = dataclasses.field(
        default="snapkv",
        metadata={
            "choices": KV_EVICTION_POLICIES,
            "help": "how --kv-budget picks what stays: snapkv (the prompt's last queries' attention, pooled) | h2o "
            "(attention accumulated over every query so far)",
        },
    )

    def __post_init__(self) -> None:
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"attention_window must be >= 1 tokens, got {self.attention_window}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {self.attention_sinks}")
        if self.attention_sinks and self.attention_window is None:
            raise ValueError("attention_sinks keep tokens beside a window: set attention_window too")
        if self.prefill_attention not in PREFILL_PATTERNS:
            raise ValueError(
                f"prefill_attention must be one of {', '.join(PREFILL_PATTERNS)}, got {self.prefill_attention!r}"
            )
        if self.prefill_window < 1 or self.prefill_globals < 0:
            raise ValueError("prefill_window must be >= 1 and prefill_globals >= 0")
        if self.prefill_attention != "full" and self.attention_window is not None:
            raise ValueError("a prefill pattern and an attention window both choose the prompt's keys: use one")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError(f"kv_budget must be >= 1 tokens, got {self.kv_budget}")
        if self.kv_eviction not in KV_EVICTION_POLICIES:
            raise ValueError(f"kv_eviction must be one of {', '.join(KV_EVICTION_POLICIES)}, got {self.kv_eviction!r}")
        if self.kv_budget is not None and (self.attention_window is not None or self.prefill_attention != "full"):
            raise ValueError("a KV budget evicts by attention scores: it does not combine with a window or pattern")

    @property
    def streams(self) -> bool:
        """Every query reads a bounded window: generation may run past the model's context."""
        return self.attention_window is not None


def long_context_names() -> set[str]:
    """The flat options (CLI flags, LLM keyword arguments) that spell a LongContextConfig."""
    return {f.name for f in dataclasses.fields(LongContextConfig)}
