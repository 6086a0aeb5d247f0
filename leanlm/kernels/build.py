"""Native CPU kernels: compile a C source on first use, cache the library, load it with ctypes.

The cache (`$LEANLM_CACHE/kernels` or `~/.cache/leanlm/kernels`, created 0700) is keyed by a hash of the
source and the build command; a cached library is loaded only when it belongs to this user and nobody else
can write it (loading a library runs its code). Libraries link against torch's own libgomp, so the process
keeps a single OpenMP runtime.
Each kernel belongs to one ISA level (isa.py: avx2, avx512, amx) and is compiled with that level's flags; a level
above the CPU's, or above the `LEANLM_ISA` cap, makes it unavailable. Any failure (no compiler, a missing CPU
flag, a compile error) makes the kernel unavailable, never an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

import torch

from leanlm.kernels import isa
from leanlm.path_trust import untrusted_reason

logger = logging.getLogger(__name__)

# The flags of every build; each level adds its explicit ISA flags (isa.COMPILE_FLAGS), never -march=native.
COMPILE_FLAGS = ("-O3", "-std=c11", "-fopenmp", "-fPIC", "-shared")


def cache_dir() -> Path:
    root = os.environ.get("LEANLM_CACHE") or Path.home() / ".cache" / "leanlm"
    return Path(root) / "kernels"


def torch_lib_dir() -> Path:
    return Path(torch.__file__).resolve().parent / "lib"


@cache
def cpu_model_name() -> str | None:
    """The first processor's "model name" in /proc/cpuinfo (a VM may show only a vendor string), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def build_command(compiler: str, source: Path, output: Path, level: str = "avx512") -> list[str]:
    lib_dir = torch_lib_dir()
    # -l:libgomp.so.1 from torch/lib (and an rpath to it): GOMP_* symbols resolve to the runtime torch
    # already loaded, instead of a second libgomp whose threads would spin against torch's.
    return [
        compiler,
        *COMPILE_FLAGS,
        *isa.COMPILE_FLAGS[level],
        str(source),
        "-o",
        str(output),
        f"-L{lib_dir}",
        "-l:libgomp.so.1",
        f"-Wl,-rpath,{lib_dir}",
    ]


_compile_lock = threading.Lock()
_compile_seconds = 0.0  # guarded by _compile_lock: seconds this process spent compiling kernels


def compile_seconds() -> float:
    """Seconds this process has spent compiling kernels (a one-time cost per machine: the cache keeps them)."""
    with _compile_lock:
        return _compile_seconds


def build_library(source: Path, level: str = "avx512") -> Path:
    """Path of the compiled library for `source` at ISA `level`, compiling it if the cache lacks this source +
    command."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    if not (torch_lib_dir() / "libgomp.so.1").exists():
        raise RuntimeError(f"torch ships no libgomp.so.1 in {torch_lib_dir()}")
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the source may include
    command = build_command(compiler, source, Path("out"), level)
    key_material = source.read_bytes() + headers + "\0".join(command).encode()
    key = hashlib.sha256(key_material).hexdigest()
    directory = cache_dir()
    target = directory / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never see a half-written library.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    global _compile_seconds
    started = time.perf_counter()
    try:
        result = subprocess.run(build_command(compiler, source, tmp, level), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{result.stderr.strip()}")
        os.chmod(tmp, 0o755)  # the linker applies the umask; a group-writable library would be refused
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        with _compile_lock:
            _compile_seconds += time.perf_counter() - started
    return target


def check_trusted(st: os.stat_result, what: Path, writable_ok: bool = False) -> None:
    """Refuse a library (or its directory) another user owns or may write: loading it would run their code."""
    if st.st_uid != os.getuid():
        raise RuntimeError(
            f"refusing {what}: owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
            "delete it or point LEANLM_CACHE at a directory of your own"
        )
    if not writable_ok and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"refusing {what}: group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}); "
            "delete it, or chmod go-w it if you trust its contents"
        )


def load_library(path: Path) -> ctypes.CDLL:
    """dlopen a cached library after checking who may have written it.

    First the directory: ours, every directory above it ours or root's and writable by no one else, and from
    here on writable by us alone (an old cache made under a 002 umask is tightened), so no one else can swap
    the file between the check and the load. Then the file itself: ours, a regular file (not a symlink),
    writable by us alone.
    """
    directory = path.parent
    st = os.stat(directory)
    check_trusted(st, directory, writable_ok=True)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(directory, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    # Above it too: whoever may write a parent can rename the cache directory and put their own in its place.
    if reason := untrusted_reason(directory.parent):
        raise RuntimeError(f"refusing the kernel cache {directory}: {reason} (or point LEANLM_CACHE elsewhere)")
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise RuntimeError(f"refusing {path}: not a regular file (a symlink?)")
    check_trusted(st, path)
    return ctypes.CDLL(str(path))


class NativeKernel:
    """One C function from one source file, built and bound on first use (thread-safe), or unavailable."""

    def __init__(
        self,
        source: Path,
        symbol: str,
        argtypes: list,
        restype,
        cpu_needs: tuple[str, ...] = ("avx512_bf16",),
        level: str = "avx512",
    ) -> None:
        if level not in isa.COMPILE_FLAGS:
            raise ValueError(f"a kernel's level is one of {', '.join(isa.COMPILE_FLAGS)}, not {level!r}")
        self.source, self.symbol, self.argtypes, self.restype = source, symbol, argtypes, restype
        self.cpu_needs = cpu_needs  # /proc/cpuinfo flags the library's instructions need beyond its level's
        self.level = level  # isa.LEVELS: the compile flags, and what the CPU and the LEANLM_ISA cap must allow
        self._fn = None
        self._reason: str | None = None
        self._lock = threading.Lock()

    def _load(self):
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(f"needs x86-64 Linux, not {sys.platform}/{platform.machine()}")
        missing = [flag for flag in self.cpu_needs if flag not in cpu_flags()]
        if missing:
            raise RuntimeError(f"the CPU lacks {', '.join(missing)}")
        if reason := isa.unavailable_reason(self.level):
            raise RuntimeError(f"needs the {self.level} level: {reason}")
        fn = getattr(load_library(build_library(self.source, self.level)), self.symbol)
        fn.argtypes, fn.restype = self.argtypes, self.restype
        return fn

    def fn(self):
        """The bound C function, or None. Failures are logged once and remembered."""
        if self._fn is None and self._reason is None:
            with self._lock:
                if self._fn is None and self._reason is None:
                    try:
                        self._fn = self._load()
                    except Exception as exc:  # any failure means "use the torch path", never a crash
                        self._reason = str(exc)
                        logger.info("native kernel %s unavailable: %s", self.symbol, exc)
        return self._fn

    def is_available(self) -> bool:
        return self.fn() is not None

    def address(self) -> int | None:
        """The function's address (what a native caller such as the decode loop calls), or None if unavailable."""
        fn = self.fn()
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    @property
    def unavailable_reason(self) -> str | None:
        self.fn()
        return self._reason
