"""The engine's thread count: fixed by --threads or OMP_NUM_THREADS, otherwise sized to the cores other processes
leave free, from /proc/stat."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.threads import ThreadSizer, threads_for


def test_threads_for_the_free_cores():
    assert threads_for(2, 0.0) == 2
    assert threads_for(2, 0.05) == 2  # a little noise does not cost a core
    assert threads_for(2, 0.2) == 1  # 0.4 of a core taken: a worker would wait at every barrier
    assert threads_for(2, 1.0) == 1  # never 0
    assert threads_for(16, 0.5) == 8
    assert threads_for(4, -0.1) == 4 and threads_for(4, 1.5) == 1  # shares out of range are clamped


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_fixed_count_is_kept_whatever_the_load(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sizer = ThreadSizer(1, cores=2, refresh_s=0.0)
    assert not sizer.is_automatic and sizer.num_threads == 1
    sizer.refresh()
    assert sizer.num_threads == 1 and sizer.num_resizes == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert not ThreadSizer(None, cores=2).is_automatic  # the user's OMP_NUM_THREADS counts as --threads


def test_automatic_threads_drop_to_one_while_other_processes_hold_the_cores(monkeypatch, restore_threads):
    """Busy loops on every core (as at load 6-9 on 2 cores): the next measurement leaves one thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = 2
    sizer = ThreadSizer(None, cores=cores, refresh_s=0.3)
    assert sizer.is_automatic and sizer.num_threads == cores  # starts on every core
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2 * cores)]
    try:
        time.sleep(0.5)
        sizer.refresh()  # measures from its start: the loops had most of it
        time.sleep(0.8)
        sizer.refresh()  # a whole interval of busy loops
        assert sizer.num_threads == 1 and sizer.num_resizes >= 1
    finally:
        for p in busy:
            p.kill()
            p.wait()


def test_threads_flag_and_its_checks():
    from leanlm.cli.main import build_parser

    for flag in ("--threads", "--num-threads"):
        args = build_parser().parse_args(["generate", "hi", flag, "3"])
        assert args.num_threads == 3
    assert build_parser().parse_args(["eval", "ppl", "--threads", "1"]).num_threads == 1
    assert build_parser().parse_args(["bench", "latency", "--threads", "1"]).num_threads == 1
    with pytest.raises(ValueError, match="--threads"):
        EngineConfig(num_threads=0)
