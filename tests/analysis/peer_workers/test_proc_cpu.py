"""proc_cpu: the shares arithmetic on made-up snapshots, and the process tree on real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from leanlm.analysis.host import CpuMonitor
from leanlm.analysis.peer_workers.proc_cpu import CpuSnapshot, cpu_shares, process_jiffies, process_tree


def test_shares_count_listed_processes_as_own_and_everything_else_as_other():
    start = CpuSnapshot(time_s=10.0, busy=1000, total=5000, own={1: 100, 2: 50, 3: 40})
    # 200 jiffies passed on all CPUs, 150 of them busy; pid 1 used 60, pid 2 20, pid 4 (new) 10; pid 3 is gone
    end = CpuSnapshot(time_s=11.0, busy=1150, total=5200, own={1: 160, 2: 70, 4: 10})
    seconds, own, other = cpu_shares(start, end)
    assert seconds == pytest.approx(1.0)
    assert own == pytest.approx(90 / 200) and other == pytest.approx(60 / 200)


def test_shares_stay_in_range_when_clocks_disagree():
    start = CpuSnapshot(0.0, busy=100, total=100, own={1: 0})
    end = CpuSnapshot(0.1, busy=101, total=100, own={1: 5})  # own above busy, no total elapsed: jiffy rounding
    _, own, other = cpu_shares(start, end)
    assert own == 1.0 and other == 0.0


def test_the_tree_holds_grandchildren_and_their_cpu_time():
    grandchild = "import time\nwhile time.process_time() < 0.2:\n    pass\nprint('ready', flush=True)\ntime.sleep(30)"
    child_code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        tree = process_tree(child.pid)
        assert tree[0] == child.pid and len(tree) == 2
        assert process_jiffies(tree[1]) >= 15  # 0.2 s at 100 jiffies/s, less rounding
    finally:
        for pid in reversed(process_tree(child.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        child.wait()
    assert process_jiffies(999_999_999) == 0  # gone: nothing


def test_cpu_monitor_counts_this_process_as_own():
    with CpuMonitor() as monitor:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.2:
            pass
    assert monitor.sample.own_share > 0 and monitor.sample.seconds >= 0.2
