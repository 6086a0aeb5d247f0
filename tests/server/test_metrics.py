"""/metrics: valid Prometheus text, and counts that follow the requests served."""

from __future__ import annotations

import re

from tests.server.conftest import MODEL
from tests.server.test_safety import _request

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})? (\S+)$')


def _parse(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")), line
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(4))
    return samples


def _histogram_count(samples: dict, name: str) -> float:
    buckets = [v for k, v in samples.items() if k.startswith(name + "_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == samples[name + "_count"]
    return samples[name + "_count"]


def test_metrics_follow_requests(real_server):
    url = real_server.url
    before = _parse(_request(url, "/metrics")[2])
    for i in range(3):
        status, _, body = _request(
            url, "/v1/completions", {"model": MODEL, "prompt": f"Count: {i}", "max_tokens": 5, "ignore_eos": True}
        )
        assert status == 200
    after = _parse(_request(url, "/metrics")[2])
    label = f'{{model_name="{MODEL}"}}'
    assert after["leanlm_generation_tokens_total" + label] - before["leanlm_generation_tokens_total" + label] == 15
    assert after["leanlm_prompt_tokens_total" + label] > before["leanlm_prompt_tokens_total" + label]
    for name, per_request in (
        ("leanlm_time_to_first_token_seconds", 1),
        ("leanlm_e2e_request_latency_seconds", 1),
        ("leanlm_inter_token_latency_seconds", 4),
    ):
        assert _histogram_count(after, name) - _histogram_count(before, name) == 3 * per_request
    length = f'{{model_name="{MODEL}",finished_reason="length"}}'
    assert after["leanlm_request_success_total" + length] - before["leanlm_request_success_total" + length] == 3
    assert 0 <= after["leanlm_kv_cache_usage_perc" + label] <= 1
