"""What the machine gives a benchmark: memory bandwidth, and how much CPU other processes took meanwhile.

Timed repetitions record the share of CPU that *other* processes used (from /proc/stat and /proc/self/stat),
so a repetition slowed by a neighbour can be discarded instead of averaged in.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from leanlm.analysis.peer_workers.proc_cpu import cpu_shares, take_snapshot
from leanlm.kernels.build import cpu_model_name
from leanlm.kernels.isa import describe as describe_isa


@dataclass(frozen=True)
class CpuSample:
    """CPU use during one timed interval."""

    seconds: float
    own_share: float  # this process (and the monitor's pids), as a fraction of all CPUs
    other_share: float  # everything else, as a fraction of all CPUs

    def is_contaminated(self, threshold: float = 0.10) -> bool:
        return self.other_share > threshold


class CpuMonitor:
    """`with CpuMonitor() as m: ...` then `m.sample` says how busy the others were. `pids` are processes that
    belong to the measurement too (a server under load from this process): their CPU counts as own."""

    def __init__(self, pids: tuple[int, ...] = ()) -> None:
        self.pids = ("self", *pids)

    def __enter__(self) -> CpuMonitor:
        self._start = take_snapshot(self.pids)
        return self

    def __exit__(self, *exc) -> None:
        seconds, own, other = cpu_shares(self._start, take_snapshot(self.pids))
        self.sample = CpuSample(seconds=seconds, own_share=own, other_share=other)


def measure_memory_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Sustained read bandwidth in bytes/s: best of `repeats` full reductions over a buffer bigger than caches."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is in KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_name() -> str:
    return cpu_model_name() or "unknown CPU"


# The instruction sets LeanLM's kernels and torch's CPU paths choose by: what a reader needs to compare two tables.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_vbmi2",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
)


def cpu_identity() -> str:
    """CPU family/model/stepping numbers (a VM may show only a vendor string as the name) and its ISA flags."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return "cpuinfo unavailable"
    flags = set(fields.get("flags", "").split())
    ids = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + str(ISA_FLAGS)
    return f"family/model/stepping {ids}, flags {isa}"


def describe_machine() -> str:
    return (
        f"{cpu_name()} ({cpu_identity()}), {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {describe_isa()}"
    )
