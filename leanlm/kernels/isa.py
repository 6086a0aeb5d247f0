"""Instruction-set levels of our native kernels, and the switch that caps them.

A level is a family of kernels compiled for one vector ISA: `avx2` (AVX2 + FMA, float32 activations: every x86-64
CPU of the last decade), `avx512` (AVX512-BF16, bf16 activations: Zen 4/5, Sapphire Rapids and later) and `amx`
(AVX512 plus the AMX tiles). `none` is PyTorch alone. The CPU's own level comes from /proc/cpuinfo; `LEANLM_ISA`
caps it (to run a smaller CPU's paths on a bigger one: the suite and the benchmarks do, per level). Importing
`leanlm` with `LEANLM_ISA` set also caps PyTorch's own kernels to the same level (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`) unless those are set already, so one switch moves both: see `torch_environment`.
"""

from __future__ import annotations

import os
import platform
from functools import cache

LEVELS = ("none", "avx2", "avx512", "amx")  # lowest first; each level's CPUs run every level below it
ENV = "LEANLM_ISA"
# The /proc/cpuinfo flags each level's kernels may use (a kernel adds its own extras, such as avx512_vnni).
LEVEL_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# gcc's flags per level: explicit ISA flags, never -march=native, so a cached library needs only what its level checks.
COMPILE_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
    "amx": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
# What PyTorch is capped to at each level: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). None: no cap.
TORCH_CAPS = {
    "none": ("default", "SSE41"),
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE_BF16"),
    "amx": (None, None),
}


def _rank(level: str) -> int:
    return LEVELS.index(level)


def cpu_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags (and those of every level below it) this CPU has; `none` off x86-64."""
    if flags is None:
        if platform.machine() not in ("x86_64", "AMD64"):
            return "none"
        flags = _flags()
    level = "none"
    for candidate in LEVELS[1:]:
        if not all(f in flags for f in LEVEL_FLAGS[candidate]):
            break
        level = candidate
    return level


def requested_cap(environ=os.environ) -> str | None:
    """The level `LEANLM_ISA` asks for (lower-cased), None when unset; a ValueError naming the choices otherwise."""
    raw = environ.get(ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in LEVELS:
        raise ValueError(f"{ENV}={environ[ENV]!r} is not a level: choose one of {', '.join(LEVELS)}")
    return raw


@cache
def active_level() -> str:
    """The level our kernels run at: the CPU's, capped by `LEANLM_ISA` (a cap above the CPU changes nothing).
    `LEANLM_DISABLE_KERNELS` (the older switch) means `none`. Read once per process."""
    if os.environ.get("LEANLM_DISABLE_KERNELS"):
        return "none"
    level, cap = cpu_level(), requested_cap()
    return level if cap is None or _rank(cap) >= _rank(level) else cap


def unavailable_reason(level: str) -> str | None:
    """Why a kernel of `level` may not run in this process (None: it may): the CPU lacks it, or the cap is lower."""
    if _rank(active_level()) >= _rank(level):
        return None
    if os.environ.get("LEANLM_DISABLE_KERNELS"):
        return "disabled by LEANLM_DISABLE_KERNELS"
    cpu = cpu_level()
    if _rank(cpu) < _rank(level):
        missing = [f for lv in LEVELS[1 : _rank(level) + 1] for f in LEVEL_FLAGS[lv] if f not in _flags()]
        return f"the CPU lacks {', '.join(missing)} (its level is {cpu})"
    return f"capped at {active_level()} by {ENV}"


def _flags() -> frozenset[str]:
    from leanlm.kernels.build import cpu_flags

    return cpu_flags()


def torch_environment(environ=os.environ) -> dict[str, str]:
    """The variables that cap PyTorch at `LEANLM_ISA`'s level, leaving any the user set alone ({} without a cap).
    They only take effect when set before torch is imported (leanlm/__init__.py does that)."""
    cap = requested_cap(environ)
    if cap is None:
        return {}
    aten, onednn = TORCH_CAPS[cap]
    out = {}
    if aten is not None and "ATEN_CPU_CAPABILITY" not in environ:
        out["ATEN_CPU_CAPABILITY"] = aten
    if onednn is not None and "ONEDNN_MAX_CPU_ISA" not in environ:
        out["ONEDNN_MAX_CPU_ISA"] = onednn
    return out


def describe() -> str:
    """One line for logs and benchmark tables: our level, the CPU's, and torch's caps where set."""
    parts = [f"kernels {active_level()} (CPU {cpu_level()})"]
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        if os.environ.get(name):
            parts.append(f"{name}={os.environ[name]}")
    return ", ".join(parts)
