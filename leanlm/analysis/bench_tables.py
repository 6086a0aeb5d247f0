"""The rows and markdown tables of `leanlm bench latency | throughput` (leanlm.analysis.bench_suite runs the sweeps):
medians of the kept repetitions, and 'n/a' where every repetition was discarded."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyRow:
    runner: str
    prompt_len: int
    output_len: int
    ttft_ms: float  # medians over the kept repetitions
    tpot_ms: float
    decode_tokens_per_s: float
    bytes_per_token: float  # what one decode step reads (weights + KV at mid-generation)
    mbu: float  # achieved bytes/s over the measured memory bandwidth
    token_times_ms: list[float]  # every per-token gap of every kept repetition (the distribution plot)
    kept: int
    discarded: int


@dataclass(frozen=True)
class ThroughputRow:
    runner: str
    batch_size: int  # requests submitted together (our engine and HF batch them; llama.cpp runs them in turn)
    output_tokens_per_s: float  # median over kept repetitions
    kept: int
    discarded: int


def _cell(value: float, spec: str) -> str:
    """A table cell: 'n/a' where no repetition was kept (a median of nothing), never 'nan'."""
    return "n/a" if math.isnan(value) else format(value, spec)


def unmeasured(rows: list[LatencyRow] | list[ThroughputRow], threshold: float) -> str | None:
    """Why the run measured nothing at some points (every repetition there was discarded), or None."""
    empty = [r for r in rows if r.kept == 0]
    if not empty:
        return None
    return (
        f"{len(empty)} of {len(rows)} points kept no repetition: other processes used more than --max-other-cpu "
        f"{threshold:.0%} of the CPUs during every one of them (their cells say n/a). Run it on a quiet machine "
        "(stop other jobs), or accept noisier numbers with a higher --max-other-cpu"
    )


def latency_table(rows: list[LatencyRow]) -> list[str]:
    lines = [
        "| runner | prompt | output | TTFT (ms) | TPOT (ms) | decode tok/s | MBU | reps kept / discarded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.runner} | {r.prompt_len} | {r.output_len} | {_cell(r.ttft_ms, ',.1f')} | {_cell(r.tpot_ms, '.2f')} "
            f"| {_cell(r.decode_tokens_per_s, '.1f')} | {_cell(r.mbu, '.0%')} | {r.kept} / {r.discarded} |"
        )
    return lines


def throughput_table(rows: list[ThroughputRow]) -> list[str]:
    runners = list(dict.fromkeys(r.runner for r in rows))
    sizes = sorted({r.batch_size for r in rows})
    value = {(r.runner, r.batch_size): r for r in rows}
    lines = [
        "| batch | "
        + " | ".join(f"{n} tok/s" for n in runners)
        + " | "
        + " | ".join(f"leanlm / {n}" for n in runners if n != "leanlm")
        + " |",
        "|---|" + "---|" * (2 * len(runners) - ("leanlm" in runners)),
    ]
    for size in sizes:
        cells = [_cell(value[(n, size)].output_tokens_per_s, ".1f") for n in runners]
        ours = value.get(("leanlm", size))
        ratios = [
            _cell(ours.output_tokens_per_s / value[(n, size)].output_tokens_per_s, ".2f").replace("n/a", "-") + "x"
            if ours
            else "-"
            for n in runners
            if n != "leanlm"
        ]
        lines.append(f"| {size} | " + " | ".join(cells + ratios) + " |")
    return lines
