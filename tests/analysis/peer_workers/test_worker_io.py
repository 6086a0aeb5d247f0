"""worker_io and proc_cpu run inside the peers' environments, where leanlm, torch and numpy may be missing: they
must import with the standard library alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import leanlm.analysis.peer_workers as peer_workers

WORKERS_DIR = Path(peer_workers.__file__).parent


def test_the_protocol_modules_need_only_the_standard_library():
    # -S: no site-packages at all (no leanlm, no torch); -I: no PYTHONPATH, no user site
    code = f"import sys; sys.path.insert(0, {str(WORKERS_DIR)!r}); import worker_io, proc_cpu; print('ok')"
    done = subprocess.run([sys.executable, "-S", "-I", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names


def test_workers_import_neither_leanlm_nor_the_other_peers_stack():
    for worker, foreign in (("openvino_worker.py", "vllm"), ("vllm_worker.py", "openvino")):
        modules = imported_modules(WORKERS_DIR / worker)
        assert "worker_io" in modules and not modules & {"leanlm", foreign, f"{foreign}_genai"}
