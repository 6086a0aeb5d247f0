"""ServerMetrics: the /metrics page in the Prometheus text exposition format (version 0.0.4).

Gauges and the engine's own counters are read from the engine thread's latest snapshot at scrape time;
token counters and latency histograms are fed, on the event loop, by every output the engine delivers.
Names follow vLLM's (`vllm:x` -> `leanlm_x`), so its dashboards port by a rename.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from leanlm.engine import AsyncLLMEngine, RequestOutput
from leanlm.sampling_params import RequestOutputKind

# Seconds; the same spirit as vLLM's buckets, from sub-millisecond decode steps to minute-long requests.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        idx = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        self.counts[idx] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            label = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{label}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.total!r}", f"{self.name}_count {self.count}"]
        return lines


@dataclass
class _Progress:
    """What the metrics have already seen of one request."""

    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(
            "leanlm_time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "leanlm_inter_token_latency_seconds", "Time between successive tokens of a request.", ITL_BUCKETS
        )
        self.e2e = Histogram("leanlm_e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self._progress: dict[str, _Progress] = {}
        engine.output_listeners.append(self.observe)

    def observe(self, output: RequestOutput) -> None:
        """Listener for every delivered output. Latencies come from the engine's own timestamps (of the first
        completion when n > 1); token counts cover every completion."""
        progress = self._progress.setdefault(output.request_id, _Progress())
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if output.kind == RequestOutputKind.DELTA:
            num_tokens += progress.num_tokens
        metrics = output.metrics
        if num_tokens > progress.num_tokens and metrics is not None and metrics.last_token_time is not None:
            if progress.num_tokens == 0 and metrics.time_to_first_token is not None:
                self.prompt_tokens += len(output.prompt_token_ids)
                self.ttft.observe(metrics.time_to_first_token)
            elif progress.last_token_time is not None:
                self.itl.observe(metrics.last_token_time - progress.last_token_time)
            progress.last_token_time = metrics.last_token_time
        self.generation_tokens += max(num_tokens - progress.num_tokens, 0)
        progress.num_tokens = num_tokens
        if output.finished:
            del self._progress[output.request_id]
            if metrics is not None and metrics.finished_time is not None:
                self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> str:
        snap = self.engine.snapshot
        stats = snap.scheduler
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        model = f'model_name="{self.model_name}"'
        metric(
            "leanlm_num_requests_running",
            "gauge",
            "Sequences in the running batch.",
            [(f"{{{model}}}", stats.num_running)],
        )
        metric(
            "leanlm_num_requests_waiting",
            "gauge",
            "Sequences waiting to be scheduled.",
            [(f"{{{model}}}", stats.num_waiting)],
        )
        metric(
            "leanlm_num_requests_in_flight",
            "gauge",
            "HTTP-level requests accepted and not yet finished.",
            [(f"{{{model}}}", self.engine.num_requests_in_flight)],
        )
        metric(
            "leanlm_kv_cache_usage_perc",
            "gauge",
            "Fraction of KV-cache blocks held by requests (1 = full).",
            [(f"{{{model}}}", stats.kv_cache_usage)],
        )
        metric(
            "leanlm_kv_cache_free_blocks",
            "gauge",
            "KV-cache blocks no request holds.",
            [(f"{{{model}}}", snap.num_free_kv_blocks)],
        )
        metric(
            "leanlm_kv_cache_total_blocks",
            "gauge",
            "KV-cache blocks in the pool.",
            [(f"{{{model}}}", snap.num_kv_blocks)],
        )
        metric(
            "leanlm_prefix_cache_hit_rate",
            "gauge",
            "Prompt tokens served by the prefix cache / looked up.",
            [(f"{{{model}}}", stats.prefix_cache_hit_rate)],
        )
        metric(
            "leanlm_num_preemptions_total",
            "counter",
            "Requests preempted (KV dropped, to be recomputed).",
            [(f"{{{model}}}", stats.num_preemptions)],
        )
        metric(
            "leanlm_request_success_total",
            "counter",
            "Finished sequences by finish reason.",
            [(f'{{{model},finished_reason="{r}"}}', stats.num_finished.get(r, 0)) for r in FINISH_REASONS],
        )
        metric(
            "leanlm_prompt_tokens_total",
            "counter",
            "Prompt tokens of requests that produced a token.",
            [(f"{{{model}}}", self.prompt_tokens)],
        )
        metric(
            "leanlm_generation_tokens_total", "counter", "Generated tokens.", [(f"{{{model}}}", self.generation_tokens)]
        )
        metric("leanlm_engine_steps_total", "counter", "Engine steps run.", [(f"{{{model}}}", snap.num_steps)])
        for histogram in (self.ttft, self.itl, self.e2e):
            lines.extend(histogram.render())
        return "\n".join(lines) + "\n"
