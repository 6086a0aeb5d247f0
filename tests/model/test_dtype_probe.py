"""dtype="auto" on a CPU: the probe times the engine's own linear layer in both dtypes, keeps bfloat16 unless
float32 is clearly faster, caches the result per machine, and an explicit dtype never probes."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.model import dtype_probe
from leanlm.model.device import resolve_dtype
from leanlm.model.dtype_probe import DECODE_ROWS, PREFILL_ROWS, choose_cpu_dtype
from tests.conftest import tiny_config


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))


def _timer(seconds: dict[torch.dtype, float], calls: list | None = None):
    def timer(layer, x):
        assert layer.weight.dtype == x.dtype and x.shape[1] == layer.in_features
        if calls is not None:
            calls.append((x.dtype, x.shape[0]))
        return seconds[x.dtype]

    return timer


def test_the_real_probe_measures_every_row_count_on_this_cpu():
    choice = choose_cpu_dtype(576, 1536)  # SmolLM2's MLP shape
    assert set(choice.bf16_speedup) == set(DECODE_ROWS + PREFILL_ROWS)
    assert all(0 < s < 100 for s in choice.bf16_speedup.values())
    assert choice.dtype in (torch.bfloat16, torch.float32) and not choice.from_cache
    assert "geometric mean" in choice.reason and "1 rows" in choice.reason


@pytest.mark.parametrize(
    "bf16_s,f32_s,expected",
    [
        (1.0, 2.0, torch.bfloat16),  # bf16 twice as fast
        (1.0, 1.0, torch.bfloat16),  # a tie keeps bf16: half the memory
        (1.03, 1.0, torch.bfloat16),  # within the probe's noise margin
        (2.0, 1.0, torch.float32),  # the Xeon case: torch's bf16 GEMM slower than float32
    ],
)
def test_the_rule_follows_the_measurement(bf16_s, f32_s, expected):
    choice = choose_cpu_dtype(64, 128, timer=_timer({torch.bfloat16: bf16_s, torch.float32: f32_s}))
    assert choice.dtype == expected
    assert choice.geomean_speedup == pytest.approx(f32_s / bf16_s)


def test_the_choice_is_cached_per_machine_and_shape(tmp_path):
    calls = []
    first = choose_cpu_dtype(64, 128, timer=_timer({torch.bfloat16: 2.0, torch.float32: 1.0}, calls))
    assert len(calls) == 2 * len(DECODE_ROWS + PREFILL_ROWS) * dtype_probe._ROUNDS and not first.from_cache
    cached = choose_cpu_dtype(64, 128, timer=_timer({torch.bfloat16: 1.0, torch.float32: 9.0}, calls))
    assert cached.from_cache and cached.dtype == torch.float32 and cached.bf16_speedup == first.bf16_speedup
    assert len(calls) == 2 * len(DECODE_ROWS + PREFILL_ROWS) * dtype_probe._ROUNDS  # nothing timed again
    other_shape = choose_cpu_dtype(64, 256, timer=_timer({torch.bfloat16: 1.0, torch.float32: 9.0}))
    assert not other_shape.from_cache and other_shape.dtype == torch.bfloat16
    path = tmp_path / "kernels" / "dtype-probe.json"
    assert len(json.loads(path.read_text())) == 2
    assert path.parent.stat().st_mode & 0o077 == 0  # private, like the kernel cache


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"x": 1}'])
def test_a_corrupt_cache_is_measured_again(tmp_path, content):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "dtype-probe.json").write_text(content)
    key = dtype_probe._cache_key(64, 128)
    if content.startswith("{"):  # a valid file with a broken entry for this machine
        (tmp_path / "kernels" / "dtype-probe.json").write_text(json.dumps({key: {"1": "nan?"}}))
    choice = choose_cpu_dtype(64, 128, timer=_timer({torch.bfloat16: 1.0, torch.float32: 3.0}))
    assert not choice.from_cache and choice.dtype == torch.bfloat16


def test_resolve_dtype_probes_only_for_auto_on_cpu(monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("probed")

    config = tiny_config(256)
    monkeypatch.setattr("leanlm.model.device.choose_cpu_dtype", no_probe)
    assert resolve_dtype("float32", torch.device("cpu"), config) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), config) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), config) == torch.bfloat16
    shapes = []

    def probe(in_features, out_features):
        shapes.append((in_features, out_features))
        return choose_cpu_dtype(in_features, out_features, timer=_timer({torch.bfloat16: 5.0, torch.float32: 1.0}))

    monkeypatch.setattr("leanlm.model.device.choose_cpu_dtype", probe)
    assert resolve_dtype("auto", torch.device("cpu"), config) == torch.float32
    assert shapes == [(config.hidden_size, config.intermediate_size)]  # the model's MLP shape
