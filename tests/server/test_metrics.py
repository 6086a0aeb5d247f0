"""/metrics: valid Prometheus text (read back by prometheus_client's own parser), and counts that follow the
requests served."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, serve_engine, wait_until
from tests.server.test_safety import _request, tiny_engine_factory  # noqa: F401  (a fixture)

# Every family the page must carry, with its type; the samples' names and labels are what dashboards read.
FAMILIES = {
    "leanlm_num_requests_running": "gauge",
    "leanlm_num_requests_waiting": "gauge",
    "leanlm_num_requests_swapped": "gauge",
    "leanlm_num_requests_in_flight": "gauge",
    "leanlm_kv_cache_usage_perc": "gauge",
    "leanlm_kv_cache_free_blocks": "gauge",
    "leanlm_kv_cache_total_blocks": "gauge",
    "leanlm_prefix_cache_hit_rate": "gauge",
    "leanlm_num_preemptions": "counter",
    "leanlm_num_swaps_out": "counter",
    "leanlm_num_swaps_in": "counter",
    "leanlm_request_success": "counter",
    "leanlm_prompt_tokens": "counter",
    "leanlm_generation_tokens": "counter",
    "leanlm_engine_steps": "counter",
    "leanlm_time_to_first_token_seconds": "histogram",
    "leanlm_inter_token_latency_seconds": "histogram",
    "leanlm_e2e_request_latency_seconds": "histogram",
    "leanlm_threads": "gauge",
    "leanlm_offload_streamed_layers": "gauge",
    "leanlm_offload_resident_layers": "gauge",
    "leanlm_tensor_parallel_size": "gauge",
    "leanlm_pipeline_parallel_size": "gauge",
    "leanlm_expert_parallel": "gauge",
}


def _parse(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label pairs): value}, through prometheus_client's parser of the text format."""
    families = list(text_string_to_metric_families(text))
    assert {f.name: f.type for f in families} == FAMILIES
    samples = {}
    for family in families:
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in samples, f"the sample {key} is written twice"
            samples[key] = sample.value
    return samples


def _histogram_count(samples: dict, name: str) -> float:
    buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in samples.items() if n == name + "_bucket")
    counts = [v for _, v in buckets]
    assert buckets[-1][0] == float("inf") and counts == sorted(counts) and counts[-1] == samples[(name + "_count", ())]
    return samples[(name + "_count", ())]


def test_metrics_follow_requests(real_server):
    url = real_server.url
    status, headers, text = _request(url, "/metrics")
    headers = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    before = _parse(text)
    for i in range(3):
        status, _, body = _request(
            url, "/v1/completions", {"model": MODEL, "prompt": f"Count: {i}", "max_tokens": 5, "ignore_eos": True}
        )
        assert status == 200
    after = _parse(_request(url, "/metrics")[2])
    model = (("model_name", MODEL),)
    for name, kind in FAMILIES.items():  # every gauge and counter is labelled by the served model
        if kind != "histogram" and name != "leanlm_request_success":
            assert (name + "_total" if kind == "counter" else name, model) in after, name
    generated = ("leanlm_generation_tokens_total", model)
    assert after[generated] - before[generated] == 15
    assert after[("leanlm_prompt_tokens_total", model)] > before[("leanlm_prompt_tokens_total", model)]
    for name, per_request in (
        ("leanlm_time_to_first_token_seconds", 1),
        ("leanlm_e2e_request_latency_seconds", 1),
        ("leanlm_inter_token_latency_seconds", 4),
    ):
        assert _histogram_count(after, name) - _histogram_count(before, name) == 3 * per_request
    length = ("leanlm_request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))
    assert after[length] - before[length] == 3
    assert 0 <= after[("leanlm_kv_cache_usage_perc", model)] <= 1
    # the layout: one process, every layer resident, on the threads torch computes with
    assert after[("leanlm_offload_streamed_layers", model)] == 0
    assert after[("leanlm_offload_resident_layers", model)] == 30
    assert after[("leanlm_tensor_parallel_size", model)] == 1 and after[("leanlm_expert_parallel", model)] == 0
    assert after[("leanlm_threads", model)] >= 1


def test_each_server_counts_its_own_requests(tiny_engine_factory):
    """Two servers in one process: each has its own registry, so neither sees the other's requests (and starting
    the second does not collide with the first's metric names)."""
    with serve_engine(tiny_engine_factory()) as first, serve_engine(tiny_engine_factory()) as second:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        assert _request(first.url, "/v1/completions", body)[0] == 200
        generated = ("leanlm_generation_tokens_total", (("model_name", MODEL),))
        assert wait_until(lambda: _parse(_request(first.url, "/metrics")[2])[generated] == 3)
        assert _parse(_request(second.url, "/metrics")[2])[generated] == 0
