"""dtype="auto" on a CPU: bfloat16 or float32, chosen by timing the engine's own linear layer on this machine.

CPU flags do not settle it: an AVX512-BF16 Xeon without AMX runs torch's bf16 F.linear at 130-167 GFLOP/s for
32-256 rows where float32 runs at 200-300, while its few-row decode products (our native GEMV) gain 2x from
reading half the bytes. The probe times both dtypes at decode and prefill row counts on the model's MLP shape
and keeps bf16 unless it is slower overall. The result is cached per machine beside the native kernel cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm.kernels import build, isa

logger = logging.getLogger(__name__)

PROBE_VERSION = 2  # bump when the probe or its rule changes: old cached choices are then re-measured
DECODE_ROWS = (1, 8)  # one request, and a small decode batch: the native GEMV's range for bf16
PREFILL_ROWS = (64, 256)  # prompt chunks: torch's GEMM in either dtype
# bf16 halves weight and KV memory, so it stays unless it is clearly slower: float32 wins only when its
# geometric-mean speedup over bf16 passes this (a 5% margin absorbs the noise of a short probe).
MIN_FLOAT32_GAIN = 1.05
_ROUNDS = 3  # every case is timed once per round, rounds interleaved: a busy spell hits one round, not a dtype
_SECONDS_PER_CASE = 0.015  # timing budget per (dtype, rows) and round: the whole probe stays under a second


@dataclass(frozen=True)
class DtypeChoice:
    """What dtype="auto" resolved to on this CPU, and the measurement behind it."""

    dtype: torch.dtype
    bf16_speedup: dict[int, float]  # rows -> float32 time / bfloat16 time on the engine's linear (> 1: bf16 faster)
    from_cache: bool  # read from the per-machine cache instead of measured now

    @property
    def geomean_speedup(self) -> float:
        return math.exp(sum(math.log(s) for s in self.bf16_speedup.values()) / len(self.bf16_speedup))

    @property
    def reason(self) -> str:
        rows = ", ".join(f"{r} rows {s:.2f}x" for r, s in self.bf16_speedup.items())
        source = "cached probe" if self.from_cache else "probe"
        return (
            f"{source}: bfloat16 vs float32 speed on this CPU's linear layer: {rows} "
            f"(geometric mean {self.geomean_speedup:.2f}x)"
        )


def _time_linear(layer: torch.nn.Module, x: torch.Tensor) -> float:
    """Best seconds per call of layer(x) over a short budget (after two warm-up calls)."""
    with torch.inference_mode():
        layer(x), layer(x)
        best = math.inf
        deadline = time.perf_counter() + _SECONDS_PER_CASE
        for i in range(1000):
            start = time.perf_counter()
            layer(x)
            end = time.perf_counter()
            best = min(best, end - start)
            if end > deadline and i >= 2:
                break
    return best


def measure(in_features: int, out_features: int, timer=_time_linear) -> dict[int, float]:
    """float32 time / bfloat16 time of the model's Linear (native GEMV where it applies) at each row count.

    On one thread: the ratio is a property of the core, and a 2-thread region on a shared 2-core machine waits
    for whichever thread another process delayed, which would make the probe measure the neighbours."""
    from leanlm.model.layers import Linear  # the layer the model runs, with its dispatch to native kernels

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    layers = {}
    for dtype in (torch.float32, torch.bfloat16):
        layer = Linear(in_features, out_features, bias=False, dtype=dtype)
        layer.weight.data.copy_(weight)
        layers[dtype] = layer
    inputs = {rows: torch.randn(rows, in_features, generator=gen) for rows in DECODE_ROWS + PREFILL_ROWS}
    best: dict[tuple[torch.dtype, int], float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(_ROUNDS):
            for rows, x in inputs.items():
                for dtype, layer in layers.items():
                    seconds = timer(layer, x.to(dtype))
                    best[dtype, rows] = min(seconds, best.get((dtype, rows), math.inf))
    finally:
        torch.set_num_threads(threads)
    return {rows: best[torch.float32, rows] / best[torch.bfloat16, rows] for rows in inputs}


def _cache_key(in_features: int, out_features: int) -> str:
    parts = [
        PROBE_VERSION,
        build.cpu_model_name() or platform.machine(),
        sorted(build.cpu_flags()),
        torch.__version__,
        in_features,
        out_features,
        isa.active_level(),  # which kernels run the layer (LEANLM_ISA, LEANLM_DISABLE_KERNELS)
        os.environ.get("ATEN_CPU_CAPABILITY", ""),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _cache_path() -> Path:
    return build.cache_dir() / "dtype-probe.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # absent, unreadable or corrupt: measure again
        return {}


def _write_cache(entries: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".dtype-probe-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError as exc:  # a read-only home still runs; it just probes again next time
        logger.debug("dtype probe not cached: %s", exc)


def choose_cpu_dtype(in_features: int, out_features: int, timer=_time_linear) -> DtypeChoice:
    """bfloat16 unless float32 runs this machine's linear layer clearly faster; cached per machine and shape."""
    key = _cache_key(in_features, out_features)
    entries = _read_cache()
    cached = entries.get(key)
    speedup = None
    if isinstance(cached, dict):
        try:
            speedup = {int(rows): float(s) for rows, s in cached.items()}
        except (TypeError, ValueError):
            speedup = None
    from_cache = bool(speedup) and all(s > 0 and math.isfinite(s) for s in speedup.values())
    if not from_cache:
        speedup = measure(in_features, out_features, timer)
        entries[key] = {str(rows): s for rows, s in speedup.items()}
        _write_cache(entries)
    choice = DtypeChoice(torch.bfloat16, speedup, from_cache)
    if 1 / choice.geomean_speedup >= MIN_FLOAT32_GAIN:
        choice = dataclasses.replace(choice, dtype=torch.float32)
    return choice
