"""leanlm.analysis.parallel_estimate: bytes per device, collective counts and the pipeline bubble."""

from __future__ import annotations

import pytest

from leanlm.analysis import estimate as est
from leanlm.analysis.estimate_report import EstimateSettings, build_report, format_report
from leanlm.analysis.hardware_profiles import HARDWARE
from leanlm.analysis.model_shape import PRESETS
from leanlm.analysis.parallel_estimate import ParallelLayout, device_weight_bytes, parallel_cost


def _shape():
    return PRESETS["llama-3-8b"]


def test_one_device_holds_every_weight_and_two_split_the_matrices():
    shape, fmt = _shape(), est.weight_format("bf16")
    whole = device_weight_bytes(shape, fmt, 1, shape.num_hidden_layers, True, True)
    assert whole == pytest.approx(est.weight_bytes(shape, fmt))
    half = device_weight_bytes(shape, fmt, 2, shape.num_hidden_layers, True, True)
    assert whole / 2 < half < whole / 2 * 1.01  # only the norms stay whole


def test_the_bubble_shrinks_with_micro_batches_and_tp_pays_on_nvlink_for_a_large_model():
    shape, fmt = _shape(), est.weight_format("bf16")
    kv = est.kv_format("bf16", shape.head_dim)
    hw = HARDWARE["h100"]
    layouts = {m: ParallelLayout(1, 4, m, 450e9, 5e-6) for m in (1, 4, 16)}
    bubbles = [parallel_cost(shape, fmt, kv, hw, layout, 64, 2048).bubble for layout in layouts.values()]
    assert bubbles == [pytest.approx(3 / 4), pytest.approx(3 / 7), pytest.approx(3 / 19)]
    tp = parallel_cost(shape, fmt, kv, hw, ParallelLayout(2, 1, 1, 450e9, 5e-6), 1, 2048)
    assert tp.all_reduces_per_microbatch == 2 * shape.num_hidden_layers + 1
    assert tp.speedup > 1.5


def test_the_report_shows_the_parallel_view_only_when_asked():
    shape, hw = _shape(), HARDWARE["h100"]
    assert "parallel" not in build_report(shape, "preset", hw, EstimateSettings())
    report = build_report(
        shape, "preset", hw, EstimateSettings(tensor_parallel_size=2, pipeline_parallel_size=2, batch=8)
    )
    assert report["parallel"]["bubble"] == pytest.approx(1 / 3)  # 2 micro-batches through 2 stages
    one = build_report(shape, "preset", hw, EstimateSettings(pipeline_parallel_size=2, batch=1))
    assert one["parallel"]["bubble"] == pytest.approx(1 / 2)  # one request cannot split: a stage always waits
    assert "TP=2 x PP=2" in format_report(report)
    with pytest.raises(ValueError, match="must be >= 1"):
        EstimateSettings(tensor_parallel_size=0)
