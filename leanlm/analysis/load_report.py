"""What a load run measured: one record per request, and the serving metrics over them.

TTFT, ITL (gaps between streamed chunks), TPOT (time per output token after the first) and end-to-end
latency, as defined by vLLM's benchmark_serving.py; plus a markdown table comparing named runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from leanlm.analysis.load_generator import LoadConfig


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds after the run started (one perf_counter clock)."""

    prompt_idx: int  # which prompt it sent
    send_s: float  # the POST went out (after any wait for the concurrency cap)
    chunk_s: tuple[float, ...]  # arrival of each chunk with non-empty text; a chunk may carry several tokens
    end_s: float  # the stream closed, or the error was seen
    num_prompt_tokens: int | None  # usage.prompt_tokens; None when the server did not report usage
    num_output_tokens: int  # usage.completion_tokens when reported, else the number of text chunks
    is_usage_reported: bool  # whether num_output_tokens came from the server's usage
    text: str  # the generated text
    error: str | None  # None: success; else why it failed (HTTP status, error event, broken stream)

    @property
    def is_success(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        """Time to the first chunk with text; None when none arrived."""
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive text chunks (a gap may cover several tokens when a chunk carries several)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(last chunk - first chunk) / (output tokens - 1): decode time per token; None below two tokens."""
        if not self.chunk_s or self.num_output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency metric in milliseconds; NaN everywhere when there were no values."""

    count: int  # how many values (requests, or chunk gaps for ITL)
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: Iterable[float]) -> LatencyStats:
        ms = np.asarray(list(values_s), dtype=np.float64) * 1000.0
        if ms.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])  # linear interpolation, as numpy and vLLM do
        return cls(int(ms.size), float(ms.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class LoadResult:
    """A finished run: its config, the model name sent, every request's record, and the wall time."""

    config: LoadConfig  # what was asked for
    model: str  # the model name the requests carried (config.model, or what /v1/models listed)
    records: tuple[RequestRecord, ...]  # in arrival order
    duration_s: float  # first arrival to last completion

    @property
    def successes(self) -> list[RequestRecord]:
        return [r for r in self.records if r.is_success]

    @property
    def num_completed(self) -> int:
        return len(self.successes)

    @property
    def num_failed(self) -> int:
        return len(self.records) - self.num_completed

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error is not None]

    @property
    def total_input_tokens(self) -> int:
        """Prompt tokens of completed requests, as reported in usage (requests without usage count 0)."""
        return sum(r.num_prompt_tokens or 0 for r in self.successes)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.successes)

    @property
    def request_throughput(self) -> float:
        """Completed requests per second of wall time."""
        return self.num_completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        """Output tokens of completed requests per second of wall time."""
        return self.total_output_tokens / self.duration_s

    @property
    def ttft(self) -> LatencyStats:
        return LatencyStats.of(r.ttft_s for r in self.successes if r.ttft_s is not None)

    @property
    def tpot(self) -> LatencyStats:
        return LatencyStats.of(r.tpot_s for r in self.successes if r.tpot_s is not None)

    @property
    def itl(self) -> LatencyStats:
        """Over the chunk gaps of all completed requests pooled together."""
        return LatencyStats.of(gap for r in self.successes for gap in r.itls_s)

    @property
    def e2e_latency(self) -> LatencyStats:
        return LatencyStats.of(r.latency_s for r in self.successes)

    def summary(self) -> dict:
        """The headline numbers, JSON-ready (NaN and inf become None and "inf")."""
        out = {
            "model": self.model,
            "completed": self.num_completed,
            "failed": self.num_failed,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2e_latency"):
            out[f"{name}_ms"] = dataclasses.asdict(getattr(self, name))
        return _json_safe(out)

    def to_dict(self) -> dict:
        """Config, summary and every record, JSON-ready."""
        return _json_safe(
            {
                "config": dataclasses.asdict(self.config),
                "summary": self.summary(),
                "records": [dataclasses.asdict(r) for r in self.records],
            }
        )


def _json_safe(value):
    """Strict JSON has no NaN or Infinity: NaN -> None, inf -> "inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def format_table(results: dict[str, LoadResult]) -> str:
    """One markdown table: a row per metric, a column per named run."""
    names = list(results)
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{r.num_completed} / {r.num_failed}" for r in results.values()]),
        ("duration (s)", [_fmt(r.duration_s, 2) for r in results.values()]),
        ("input / output tokens", [f"{r.total_input_tokens} / {r.total_output_tokens}" for r in results.values()]),
        ("requests/s", [_fmt(r.request_throughput, 2) for r in results.values()]),
        ("output tokens/s", [_fmt(r.output_throughput) for r in results.values()]),
    ]
    for label, attr in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e_latency")):
        stats = [getattr(r, attr) for r in results.values()]
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (ms)", [_fmt(getattr(s, stat)) for s in stats]))
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)
