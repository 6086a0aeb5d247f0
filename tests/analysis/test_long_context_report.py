"""The long-context part of `leanlm estimate`'s text: columns only for the bounds asked for, the model's own
context marked when it is known."""

from __future__ import annotations

from leanlm.analysis.estimate import kv_format
from leanlm.analysis.estimate_long_context import BoundedAttention
from leanlm.analysis.long_context_report import long_context_lines, long_context_report
from leanlm.analysis.model_shape import ModelShape

TINY = ModelShape("tiny", 10, 8, 8, 2, 2, 1, 4, max_context=6)
KV = kv_format("bf16", TINY.head_dim)


def test_a_window_alone_shows_no_budget_columns():
    text = "\n".join(long_context_lines(long_context_report(TINY, KV, BoundedAttention(window=2, sinks=1))))
    assert "window 2+1" in text and "budget" not in text
    assert "*: the model's own context (6)" in text and "\n6*  " in text
    assert "KV 32 B per token" in text  # 2 (K, V) x 2 layers x 1 KV head x 4 dims x 2 bytes


def test_a_budget_alone_shows_the_full_prefill_and_says_why():
    unknown = ModelShape("tiny", 10, 8, 8, 2, 2, 1, 4)
    report = long_context_report(unknown, KV, BoundedAttention(kv_budget=4))
    text = "\n".join(long_context_lines(report))
    assert "decode budget 4" in text and "prefill budget" not in text and "window" not in text
    assert "attended in full before eviction" in text and "own context" not in text
    assert [r["context"] for r in report["rows"]][0] == 4096
