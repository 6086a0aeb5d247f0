"""How many threads a step computes on: a fixed count (`--threads N`, or OMP_NUM_THREADS), or sized to the cores
other processes leave free, re-measured from /proc/stat while the engine runs.

Why: a step is hundreds of OpenMP parallel regions (every linear, every layer), each ending at a barrier. When
another process holds a core, one of our workers is descheduled and the others spin at every barrier until it runs
again: at load 6-9 on 2 cores `leanlm generate` ran 5-50x slower on 2 threads than on 1. llama.cpp and vLLM-CPU
both take every core they are given and leave contention to the operator; we size to what is free instead.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from leanlm.analysis.peer_workers.proc_cpu import CpuSnapshot, cpu_shares, take_snapshot

logger = logging.getLogger(__name__)

REFRESH_S = 2.0  # how often the free cores are re-measured (one /proc/stat read: ~50 us)
FIRST_REFRESH_S = 0.25  # the first measurement comes sooner: a busy machine is busy from the start
HEADROOM = 0.25  # a core counts as free when others left at least 75% of it


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_for(cores: int, other_share: float) -> int:
    """Threads for `cores` CPUs of which others used `other_share` (0-1 of all of them): the cores they left free,
    rounded down unless nearly whole, at least 1."""
    free = cores * (1.0 - min(max(other_share, 0.0), 1.0))
    return max(1, min(cores, math.floor(free + HEADROOM)))


def _fixed_from_environment() -> int | None:
    """A thread count the user set with OMP_NUM_THREADS (which torch already follows): kept as it is."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


class ThreadSizer:
    """Sets torch's thread count; `refresh()` before each step re-sizes an automatic count at most every REFRESH_S
    seconds. `num_threads` None: automatic (unless OMP_NUM_THREADS is set, which counts as fixed)."""

    def __init__(self, num_threads: int | None, cores: int | None = None, refresh_s: float = REFRESH_S) -> None:
        self.cores = cores or usable_cores()
        fixed = num_threads or _fixed_from_environment()
        self.is_automatic = fixed is None
        self.refresh_s = refresh_s
        self._interval = min(FIRST_REFRESH_S, refresh_s)
        self.num_resizes = 0  # times an automatic count changed (the engine's stats)
        self._last: CpuSnapshot = take_snapshot(("self",))
        self._set(fixed or self.cores)

    @property
    def num_threads(self) -> int:
        return torch.get_num_threads()

    def _set(self, n: int) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def refresh(self) -> None:
        """Re-size an automatic count from the CPU others used since the last measurement."""
        if not self.is_automatic or time.perf_counter() - self._last.time_s < self._interval:
            return
        self._interval = self.refresh_s
        now = take_snapshot(("self",))
        _, _, other = cpu_shares(self._last, now)
        self._last = now
        n = threads_for(self.cores, other)
        if n != torch.get_num_threads():
            logger.info("other processes used %.0f%% of the CPUs: computing on %d thread(s)", 100 * other, n)
            self.num_resizes += 1
            self._set(n)
