"""Every benchmark script still imports: a module moved or a name renamed in leanlm fails here, not in the next
session that runs the benchmark. A peer's own package that is not installed (compressed_tensors, ...) is fine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# Importing a script runs only its definitions (each runs its work under a __main__ guard). One child process
# imports them all, as the scripts run: with benchmarks/ on the path for their shared helpers.
CHECK = """
import importlib, sys
local = set(sys.argv[1:])
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        root = exc.name.partition('.')[0]
        if root in ('leanlm', 'tests') or root in local:
            print(f'{name}: {exc!r}')
    except Exception as exc:
        print(f'{name}: {exc!r}')
"""


def test_every_benchmark_script_imports():
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *names],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{BENCHMARKS}{os.pathsep}{BENCHMARKS.parent}"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", done.stdout


def test_serving_overhead_phases_name_existing_functions():
    """benchmarks/serving_overhead.py wraps functions by name: a rename must fail here, not in its next run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_overhead", BENCHMARKS / "serving_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for module_name, path, label in module.PHASES:
        owner = importlib.import_module(module_name)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(owner), f"{label}: {module_name}.{path} is not callable"
