"""Serving metrics over hand-made request records: exact values, the table, strict JSON."""

from __future__ import annotations

import json
import math

import pytest

from leanlm.analysis.load_generator import LoadConfig
from leanlm.analysis.load_report import LatencyStats, LoadResult, RequestRecord, format_table


def record(send_s, chunk_s, end_s, num_output_tokens, error=None, num_prompt_tokens=10) -> RequestRecord:
    return RequestRecord(
        prompt_idx=0,
        send_s=send_s,
        chunk_s=tuple(chunk_s),
        end_s=end_s,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        is_usage_reported=True,
        text="",
        error=error,
    )


def result(records, duration_s=2.0) -> LoadResult:
    return LoadResult(config=LoadConfig(), model="m", records=tuple(records), duration_s=duration_s)


def test_request_metrics():
    r = record(1.0, [1.5, 1.6, 1.9], 2.0, num_output_tokens=5)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itls_s == pytest.approx([0.1, 0.3])
    assert r.tpot_s == pytest.approx(0.4 / 4)  # the last chunk carried three tokens
    assert r.latency_s == pytest.approx(1.0)
    assert record(0.0, [0.2], 0.3, num_output_tokens=1).tpot_s is None
    assert record(0.0, [], 0.3, num_output_tokens=0).ttft_s is None


def test_latency_stats_in_ms():
    stats = LatencyStats.of([0.001 * i for i in range(1, 101)])
    assert stats.count == 100
    assert stats.mean == pytest.approx(50.5)
    assert stats.p50 == pytest.approx(50.5)
    assert stats.p90 == pytest.approx(90.1)
    assert stats.p99 == pytest.approx(99.01)
    empty = LatencyStats.of([])
    assert empty.count == 0 and math.isnan(empty.p50)


def test_result_totals_count_only_successes():
    res = result(
        [
            record(0.0, [0.1, 0.2], 0.3, 4),
            record(0.0, [0.2, 0.4], 0.5, 4),
            record(0.0, [], 0.1, 0, error="HTTP 500: x", num_prompt_tokens=None),
        ]
    )
    assert (res.num_completed, res.num_failed) == (2, 1)
    assert res.errors == ["HTTP 500: x"]
    assert (res.total_input_tokens, res.total_output_tokens) == (20, 8)
    assert res.output_throughput == pytest.approx(4.0)
    assert res.request_throughput == pytest.approx(1.0)
    assert res.ttft.mean == pytest.approx(150.0)
    assert res.itl.count == 2 and res.e2e_latency.p50 == pytest.approx(400.0)


def test_table_and_json():
    ours = result([record(0.0, [0.1, 0.2], 0.3, 2)])
    failed = result([record(0.0, [], 0.1, 0, error="boom")])
    table = format_table({"ours": ours, "peer": failed})
    lines = table.splitlines()
    assert lines[0] == "| metric | ours | peer |"
    assert "| completed / failed | 1 / 0 | 0 / 1 |" in lines
    assert any(line.startswith("| TTFT p50 (ms) | 100.0 | - |") for line in lines)
    text = json.dumps(failed.to_dict(), allow_nan=False)  # strict JSON: no NaN, no Infinity
    data = json.loads(text)
    assert data["config"]["request_rate"] == "inf"
    assert data["summary"]["ttft_ms"]["p50"] is None
    assert data["records"][0]["error"] == "boom"
