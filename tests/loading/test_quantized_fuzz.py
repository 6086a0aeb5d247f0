"""Seeded fuzzing of the quantized-checkpoint loaders (tests/loading/quantized_fuzz.py), as the GGUF header is
fuzzed: every mutated checkpoint is refused with a ModelLoadError or loads and generates finite logprobs,
within a per-case time limit and a memory bound, in a child process (a crash is a failure, not the end of the
run). Findings it made when written: a config claiming 2**31 layers hung the loader, a GPTQ qweight with no
columns raised a RuntimeError, an LLM.int8() threshold of [] or null loaded and gave non-finite logprobs."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUM_CASES = 120
MAX_RSS_BYTES = 3 << 30


def test_mutated_quantized_checkpoints_are_refused_or_run():
    result = subprocess.run(
        [sys.executable, "-m", "tests.loading.quantized_fuzz", "2026", str(NUM_CASES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    *rows, peak = [json.loads(line) for line in result.stdout.splitlines()]
    bases = [r for r in rows if not r["mutations"]]
    assert len(bases) == 6 and all(r["outcome"][0] == "ran" for r in bases), bases  # the intact ones run
    findings = [r for r in rows if r["outcome"][0] == "finding"]
    assert not findings, json.dumps(findings, indent=1)
    outcomes = collections.Counter(r["outcome"][0] for r in rows[len(bases) :])
    assert sum(outcomes.values()) == NUM_CASES
    assert outcomes["refused"] >= NUM_CASES // 2 and outcomes["ran"] >= 5, outcomes  # both paths are exercised
    assert peak["max_rss_kib"] * 1024 < MAX_RSS_BYTES, f"the fuzzing process peaked at {peak['max_rss_kib'] >> 10} MiB"
