"""CPU time from /proc: how busy all CPUs were over an interval, and how much of it a set of processes used.

Standard library only, on purpose: peer workers load this file inside other virtual environments, where leanlm
cannot be imported, to measure their own process tree around each repetition; host.CpuMonitor uses the same
functions, so both sides count "own" and "other" CPU the same way.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


def system_busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - idle, total


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_jiffies(pid: int | str = "self") -> int:
    """utime + stime of a process and its threads, plus what its waited-for children used; 0 once it is gone."""
    fields = _stat_fields(pid)
    return sum(int(x) for x in fields[11:15]) if fields else 0  # utime stime cutime cstime


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant (children, grandchildren, ...), from one scan of /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := _stat_fields(name)):
            children.setdefault(int(fields[1]), []).append(int(name))  # fields[1] is the parent pid
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


@dataclass(frozen=True)
class CpuSnapshot:
    """The clocks at one instant: wall time, all CPUs' jiffies, and the jiffies of each process counted as own."""

    time_s: float  # time.perf_counter()
    busy: int  # jiffies all CPUs spent busy since boot
    total: int  # jiffies all CPUs spent, busy or idle
    own: dict[int | str, int]  # pid -> its jiffies (process_jiffies)


def take_snapshot(pids) -> CpuSnapshot:
    busy, total = system_busy_jiffies()
    return CpuSnapshot(time.perf_counter(), busy, total, {pid: process_jiffies(pid) for pid in pids})


def cpu_shares(start: CpuSnapshot, end: CpuSnapshot) -> tuple[float, float, float]:
    """(seconds, own share, other share) of all CPUs between two snapshots. Own is what the processes listed at
    `end` used since `start` (a process first seen at `end` started meanwhile: all of its time counts); other is
    every other busy jiffy. A process that exited meanwhile counts only through its parent's waited-for
    children time (cutime), so list the processes again at the end rather than reusing the start's list."""
    own = sum(max(jiffies - start.own.get(pid, 0), 0) for pid, jiffies in end.own.items())
    total = max(end.total - start.total, 1)
    busy = end.busy - start.busy
    return end.time_s - start.time_s, min(own / total, 1.0), max(busy - own, 0) / total
