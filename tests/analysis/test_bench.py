"""`leanlm bench latency | throughput`: runners on the real model produce exactly the tokens asked for, and the
report keeps contaminated repetitions apart."""

from __future__ import annotations

import pytest

from leanlm.analysis.bench import HFRunner, LeanLMRunner, Repetitions, repeat
from leanlm.analysis.bench_tables import LatencyRow, ThroughputRow, latency_table, throughput_table, unmeasured
from leanlm.analysis.host import CpuSample


@pytest.fixture(scope="module")
def llm():
    from leanlm import LLM

    return LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, progress=False)


@pytest.mark.real_model
def test_leanlm_runner_latency_and_throughput(llm, real_tokenizer):
    prompt = real_tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    sample = LeanLMRunner(llm).latency(prompt, 6)
    assert sample.ttft_s > 0 and len(sample.token_times_s) == 5 and all(t > 0 for t in sample.token_times_s)
    assert LeanLMRunner(llm).throughput([prompt, prompt[:4]], 5) > 0
    assert not llm.llm_engine.has_unfinished_requests()


def test_hf_runner_times_every_token(hf_smollm, real_tokenizer):
    prompt = real_tokenizer.encode("Hello there")
    sample = HFRunner(hf_smollm, pad_id=0).latency(prompt, 5)
    assert len(sample.token_times_s) == 4 and sample.ttft_s > 0


def test_llama_cpp_runner_gives_exact_token_counts(smollm_path, real_tokenizer):
    pytest.importorskip("llama_cpp")
    from leanlm.analysis.bench import LlamaCppRunner

    runner = LlamaCppRunner(smollm_path, n_ctx=128, n_threads=1)
    sample = runner.latency(real_tokenizer.encode("Hello there"), 6)
    assert len(sample.token_times_s) == 5


def test_contaminated_repetitions_are_kept_apart():
    reps = Repetitions()
    reps.add(1.0, CpuSample(1.0, 0.9, 0.05), threshold=0.1)
    reps.add(2.0, CpuSample(1.0, 0.5, 0.40), threshold=0.1)
    assert reps.values == [1.0] and reps.discarded == [0.40] and reps.other_shares == [0.05]
    assert len(repeat(lambda: 3, 2, threshold=1.0).values) == 2


def test_throughput_table_ratios():
    rows = [ThroughputRow("leanlm", 4, 100.0, 3, 0), ThroughputRow("hf", 4, 40.0, 3, 0)]
    table = throughput_table(rows)
    assert table[0] == "| batch | leanlm tok/s | hf tok/s | leanlm / hf |"
    assert table[2] == "| 4 | 100.0 | 40.0 | 2.50x |"


def test_a_point_with_every_repetition_discarded_says_n_a_not_nan():
    rows = [ThroughputRow("leanlm", 4, float("nan"), 0, 3), ThroughputRow("hf", 4, 40.0, 3, 0)]
    assert throughput_table(rows)[2] == "| 4 | n/a | 40.0 | -x |"
    assert "1 of 2 points kept no repetition" in unmeasured(rows, 0.1) and "--max-other-cpu 10%" in unmeasured(
        rows, 0.1
    )
    assert unmeasured(rows[1:], 0.1) is None


def test_a_latency_row_with_no_kept_repetition_says_n_a():
    row = LatencyRow("leanlm", 128, 64, float("nan"), float("nan"), float("nan"), 1e8, float("nan"), [], 0, 3)
    assert latency_table([row])[2] == "| leanlm | 128 | 64 | n/a | n/a | n/a | n/a | 0 / 3 |"


def test_bench_on_a_busy_machine_fails_says_why_and_leaves_the_doc(tmp_path, monkeypatch, capsys):
    """Every repetition contaminated (as on a machine at load 6 on 2 cores): the report is printed (n/a cells), the
    command exits 1 with the reason naming --max-other-cpu, and the --doc keeps what it had."""
    from leanlm.analysis import bench_suite
    from leanlm.cli.main import main

    rows = [ThroughputRow("leanlm", 1, float("nan"), 0, 3)]
    report = bench_suite.SuiteReport("\n".join(throughput_table(rows)), unmeasured(rows, 0.1))
    monkeypatch.setattr(bench_suite, "throughput_command", lambda args: report)
    doc = tmp_path / "doc.md"
    doc.write_text("kept\n")
    assert main(["bench", "throughput", "--batch-sizes", "1", "--doc", str(doc)]) == 1
    out, err = capsys.readouterr()
    assert "| 1 | n/a |" in out and "nan" not in out
    assert "1 of 1 points kept no repetition" in err and "--max-other-cpu" in err
    assert doc.read_text() == "kept\n"
