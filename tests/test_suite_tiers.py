"""The suite's tiers: every long real-model run that `make test` leaves to `make test-slow` still exists under the
name tests/conftest.py lists (a rename would otherwise drop it from both tiers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import LONG_REAL_MODEL_RUNS

ROOT = Path(__file__).resolve().parents[1]


def test_every_long_run_is_collected_as_slow():
    files = sorted({name.split("::")[0] for name in LONG_REAL_MODEL_RUNS})
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "slow", *files]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout.splitlines()
    missing = sorted(LONG_REAL_MODEL_RUNS - set(listed))
    assert not missing, f"tests/conftest.py names tests that do not exist: {missing}"
