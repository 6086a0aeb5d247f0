"""ServerMetrics: the /metrics page, rendered by prometheus_client from a registry of this app's own.

Gauges and the engine's own counters are read from the engine thread's latest snapshot at scrape time;
token counters and latency histograms are fed, on the event loop, by every output the engine delivers.
Names follow vLLM's (`vllm:x` -> `leanlm_x`), so its dashboards port by a rename.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from leanlm.engine import AsyncLLMEngine, RequestOutput
from leanlm.sampling_params import RequestOutputKind

# Seconds; the same spirit as vLLM's buckets, from sub-millisecond decode steps to minute-long requests.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class _Progress:
    """What the metrics have already seen of one request."""

    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics(Collector):
    """One per app: it owns a CollectorRegistry (several servers share a test process, so never the global one),
    holds the histograms and token counts, and is itself the collector of everything read at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "leanlm_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self.itl = Histogram(
            "leanlm_inter_token_latency_seconds",
            "Time between successive tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=None,
        )
        self.e2e = Histogram(
            "leanlm_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=None,
        )
        self.registry.register(self)
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

    def collect(self) -> Iterator[Metric]:
        """Every family of the page, at scrape time (the registry's Collector protocol)."""
        snap = self.engine.snapshot  # one snapshot per scrape, so the numbers agree with each other
        stats = snap.scheduler
        model = [self.model_name]
        for name, help_text, value in (
            ("leanlm_num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("leanlm_num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("leanlm_num_requests_swapped", "Sequences swapped out to host memory.", stats.num_swapped),
            (
                "leanlm_num_requests_in_flight",
                "HTTP-level requests accepted and not yet finished.",
                self.engine.num_requests_in_flight,
            ),
            (
                "leanlm_kv_cache_usage_perc",
                "Fraction of KV-cache blocks held by requests (1 = full).",
                stats.kv_cache_usage,
            ),
            ("leanlm_kv_cache_free_blocks", "KV-cache blocks no request holds.", snap.num_free_kv_blocks),
            ("leanlm_kv_cache_total_blocks", "KV-cache blocks in the pool.", snap.num_kv_blocks),
            (
                "leanlm_prefix_cache_hit_rate",
                "Prompt tokens served by the prefix cache / looked up.",
                stats.prefix_cache_hit_rate,
            ),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        finished = CounterMetricFamily(
            "leanlm_request_success", "Finished sequences by finish reason.", labels=["model_name", "finished_reason"]
        )
        for reason in FINISH_REASONS:
            finished.add_metric([self.model_name, reason], stats.num_finished.get(reason, 0))
        yield finished
        for name, help_text, value in (
            ("leanlm_num_preemptions", "Requests preempted (KV dropped, to be recomputed).", stats.num_preemptions),
            ("leanlm_num_swaps_out", "Requests preempted by swapping their KV to host memory.", stats.num_swaps_out),
            ("leanlm_num_swaps_in", "Swapped-out requests brought back to the KV cache.", stats.num_swaps_in),
            ("leanlm_prompt_tokens", "Prompt tokens of requests that produced a token.", self.prompt_tokens),
            ("leanlm_generation_tokens", "Generated tokens.", self.generation_tokens),
            ("leanlm_engine_steps", "Engine steps run.", snap.num_steps),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            counter.add_metric(model, value)
            yield counter
        yield from self._moe_families()
        yield from self._layout_families()
        for histogram in (self.ttft, self.itl, self.e2e):
            for family in histogram.collect():
                # The series of the page are the buckets, _sum and _count; _created (when prometheus_client
                # adds it) would be a new series per histogram that no dashboard of ours reads.
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family

    def _layout_families(self) -> Iterator[Metric]:
        """How the engine is laid out: threads now (they follow the machine's load), offloaded layers, the
        parallel layout."""
        layout = self.engine.engine.layout()
        for name, help_text, value in (
            ("leanlm_threads", "CPU threads a step computes on now (per rank).", layout.num_threads),
            ("leanlm_offload_streamed_layers", "Decoder layers whose weights stream in as they run.",
             layout.num_streamed_layers),
            ("leanlm_offload_resident_layers", "Decoder layers whose weights stay in memory.",
             layout.num_layers - layout.num_streamed_layers),
            ("leanlm_tensor_parallel_size", "Processes each layer is split across.", layout.tensor_parallel_size),
            ("leanlm_pipeline_parallel_size", "Pipeline stages.", layout.pipeline_parallel_size),
            ("leanlm_expert_parallel", "1 when experts are split over the tensor ranks.", int(layout.expert_parallel)),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge

    def _moe_families(self) -> Iterator[Metric]:
        """A mixture-of-experts model's routing: per layer and expert load, drops, expert bytes read per token."""
        moe = self.engine.engine.moe_stats()
        if moe is None:
            return
        load = CounterMetricFamily("leanlm_moe_expert_assignments", "Tokens each expert ran, per MoE layer.",
                                   labels=["model_name", "layer", "expert"])  # fmt: skip
        for layer, counts in enumerate(moe.expert_load):
            for expert, count in enumerate(counts):
                load.add_metric([self.model_name, str(layer), str(expert)], count)
        yield load
        for name, help_text, value in (
            ("leanlm_moe_assignments", "Token-expert assignments the routers asked for.", moe.assignments),
            ("leanlm_moe_dropped", "Assignments beyond an expert's capacity (the token skipped it).", moe.dropped),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter
        gauge = GaugeMetricFamily("leanlm_moe_expert_bytes_per_token", "Expert weight bytes read per token so far.",
                                  labels=["model_name"])  # fmt: skip
        gauge.add_metric([self.model_name], moe.expert_bytes_per_token)
        yield gauge

    def render(self) -> str:
        return generate_latest(self.registry).decode()
