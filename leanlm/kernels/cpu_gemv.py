"""A bfloat16 linear layer for a few rows (batch-1..8 decode) on x86-64 CPUs with AVX512-BF16.

Compiles gemv_bf16.c on first use into the kernel cache (`$LEANLM_CACHE/kernels` or
`~/.cache/leanlm/kernels`), keyed by a hash of the source and the build command, and calls it through
ctypes. The library links against torch's own libgomp so the process keeps a single OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).with_name("gemv_bf16.c")
# Explicit ISA flags (not -march=native): the cached library must not depend on which machine built it
# beyond the features is_available() checks for.
COMPILE_FLAGS = (
    "-O3", "-std=c11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
    "-fopenmp", "-fPIC", "-shared",
)  # fmt: skip
MAX_ROWS = 8  # should_use() accepts up to this many rows of x (one pass over W)
# Below this many weight bytes one thread does the whole matrix: waking the OpenMP pool costs a few
# microseconds; a second core still saves ~20% on a 192x576 (221 KB) matrix.
MIN_PARALLEL_BYTES = 64 * 1024

_lock = threading.Lock()
_state: dict[str, object] = {}  # "fn": the bound C function, or "reason": why it is unavailable


def _cache_dir() -> Path:
    root = os.environ.get("LEANLM_CACHE") or Path.home() / ".cache" / "leanlm"
    return Path(root) / "kernels"


def _torch_lib_dir() -> Path:
    return Path(torch.__file__).resolve().parent / "lib"


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _build_command(compiler: str, output: Path) -> list[str]:
    lib_dir = _torch_lib_dir()
    # -l:libgomp.so.1 from torch/lib (and an rpath to it): GOMP_* symbols resolve to the runtime torch
    # already loaded, instead of a second libgomp whose threads would spin against torch's.
    return [compiler, *COMPILE_FLAGS, str(SOURCE_PATH), "-o", str(output),
            f"-L{lib_dir}", "-l:libgomp.so.1", f"-Wl,-rpath,{lib_dir}"]  # fmt: skip


def _build() -> Path:
    """Path of the compiled library, compiling it if the cache lacks this source + command."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    if not (_torch_lib_dir() / "libgomp.so.1").exists():
        raise RuntimeError(f"torch ships no libgomp.so.1 in {_torch_lib_dir()}")
    source = SOURCE_PATH.read_bytes()
    key = hashlib.sha256(source + "\0".join(_build_command(compiler, Path("out"))).encode()).hexdigest()
    cache = _cache_dir()
    target = cache / f"gemv_bf16-{key[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never see a half-written library.
    fd, tmp_name = tempfile.mkstemp(prefix=".gemv_bf16-", suffix=".so", dir=cache)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        result = subprocess.run(_build_command(compiler, tmp), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE_PATH.name} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _load() -> None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"needs x86-64 Linux, not {sys.platform}/{platform.machine()}")
    if "avx512_bf16" not in _cpu_flags():
        raise RuntimeError("the CPU lacks avx512_bf16")
    lib = ctypes.CDLL(str(_build()))
    fn = lib.leanlm_linear_bf16
    c_i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p] * 4 + [c_i64, c_i64, c_i64, ctypes.c_int, c_i64]
    fn.restype = ctypes.c_int
    _state["fn"] = fn


def _kernel():
    """The bound C function, or None. Builds and loads once per process; failures are logged once."""
    if "fn" not in _state and "reason" not in _state:
        with _lock:
            if "fn" not in _state and "reason" not in _state:
                try:
                    _load()
                except Exception as exc:  # any failure means "use F.linear", never a crash
                    _state["reason"] = str(exc)
                    logger.info("CPU bf16 GEMV kernel unavailable: %s", exc)
    return _state.get("fn")


def is_available() -> bool:
    """True when the kernel is built and loaded (x86-64 Linux, AVX512-BF16, a C compiler)."""
    return _kernel() is not None


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True)."""
    _kernel()
    return _state.get("reason")  # type: ignore[return-value]


def should_use(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Policy: route F.linear(x, weight) here for contiguous bf16 CPU tensors with at most MAX_ROWS rows."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and x.numel() <= MAX_ROWS * weight.shape[1]
        and x.is_contiguous()
        and weight.is_contiguous()
        and is_available()
    )


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The slow path of linear_bf16's argument check: say what is wrong."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match: want [..., K], [N, K]")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {t.dtype} on {t.device}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")


_BF16 = torch.bfloat16


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 CPU tensors: x [..., K] @ weight[N, K]^T + bias[N] -> [..., N], fp32 accumulation.

    x, weight and bias must be contiguous bfloat16 on the CPU (checked: the C code reads raw pointers).
    Any number of rows works, but W is re-read every MAX_ROWS rows, so it only pays for small M.
    Runs on torch.get_num_threads() threads.
    """
    fn = _state.get("fn") or _kernel()
    if fn is None:
        raise RuntimeError(f"CPU bf16 GEMV kernel unavailable: {_state.get('reason')}")
    # The fast check (one expression: this runs ~200 times per decoded token); _check_args explains.
    if not (
        weight.dim() == 2
        and x.dtype is _BF16 and weight.dtype is _BF16
        and x.is_cpu and weight.is_cpu
        and x.is_contiguous() and weight.is_contiguous()
        and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
        and (bias is None or (bias.dtype is _BF16 and bias.is_cpu and bias.is_contiguous()
                              and bias.shape == weight.shape[:1]))
    ):  # fmt: skip
        _check_args(x, weight, bias)
    N, K = weight.shape
    y = torch.empty(x.shape[:-1] + (N,), dtype=_BF16)
    if K == 0:  # an empty sum: the bias alone
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    rc = fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            x.numel() // K, N, K, torch.get_num_threads(), MIN_PARALLEL_BYTES)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"leanlm_linear_bf16 failed (code {rc})")
    return y
