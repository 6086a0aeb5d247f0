"""PeerRunner in `leanlm bench throughput`: one worker run per peer covering every batch size, contaminated
repetitions (by the worker's own CPU accounting) kept apart, and the checks made before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from leanlm.analysis.bench import Repetitions
from leanlm.analysis.bench_suite import run_throughput
from leanlm.analysis.peer_process import PeerSpec
from leanlm.analysis.peer_runner import PeerRunner

PROMPTS = ((1, 2, 3), (10, 20), (7,))


def test_peer_runner_keeps_contaminated_repetitions_apart(fake_peer_spec):
    runner = PeerRunner("fake", fake_peer_spec, Path("/nowhere"), max_num_seqs=2, options={"fake": "ok"})
    kept = runner.throughput_sweep([list(p) for p in PROMPTS], [1, 3], 4, reps=2, threshold=1.0)
    assert sorted(kept) == [1, 3] and all(len(r.values) == 2 and not r.discarded for r in kept.values())
    assert runner.info["peer"] == "fake"
    dropped = runner.throughput_sweep([list(p) for p in PROMPTS], [3], 4, reps=2, threshold=-1.0)  # all "dirty"
    assert dropped[3].values == [] and len(dropped[3].discarded) == 2


class _InProcess:
    name = "inproc"

    def __init__(self):
        self.calls = []

    def throughput(self, prompts, output_len):
        self.calls.append((len(prompts), output_len))
        return 10.0 * len(prompts)


class _Sweeping:
    name = "sweeper"

    def throughput_sweep(self, prompts, batch_sizes, output_len, reps, threshold):
        out = {}
        for b in batch_sizes:
            out[b] = Repetitions()
            out[b].values = [100.0 * b] * reps
        return out


def test_run_throughput_sweeps_process_peers_once_and_orders_rows_by_batch():
    inproc = _InProcess()
    rows = run_throughput([inproc, _Sweeping()], [[1]] * 4, [1, 4], output_len=3, reps=2, threshold=1.0)
    assert [(r.runner, r.batch_size, r.output_tokens_per_s, r.kept) for r in rows] == [
        ("inproc", 1, 10.0, 2),
        ("sweeper", 1, 100.0, 2),
        ("inproc", 4, 40.0, 2),
        ("sweeper", 4, 400.0, 2),
    ]
    assert inproc.calls == [(1, 4), (1, 3), (1, 3), (1, 4), (4, 3), (4, 3)]  # warm-up, then the repetitions


def test_bench_checks_process_peers_before_any_model_loads(monkeypatch, tmp_path):
    from leanlm.analysis import bench_suite

    with pytest.raises(ValueError, match=r"unknown peers \['openvino-int3'\]"):
        bench_suite.check_peers(["openvino-int3"], throughput=True)
    with pytest.raises(ValueError, match=r"\['vllm'\] run in processes of their own and measure throughput only"):
        bench_suite.check_peers(["vllm"], throughput=False)
    missing = PeerSpec("vllm", tmp_path / "none", tmp_path / "worker.py", "make peers-vllm")
    monkeypatch.setitem(bench_suite.PROCESS_PEERS, "vllm", (missing, None))
    with pytest.raises(ValueError, match="vllm is not set up .*make peers-vllm"):
        bench_suite.check_peers(["vllm"], throughput=True)
