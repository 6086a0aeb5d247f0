"""What this machine gives the local processes of one engine or router: a free loopback port, a share of the cores,
and a child process that does not outlive its parent."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick; a race with other programs is possible but harmless: the
    process that loses it fails to start and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def cores_per_process(num_processes: int) -> int:
    """This process's CPUs shared out evenly over `num_processes` local processes (at least one each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(num_processes, 1))


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, even by SIGKILL, so no child is orphaned."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_child(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`command` as a child that gets SIGTERM when this process dies (Linux; strictly: when the thread that started
    it ends, so start children from a thread that lives as long as they do)."""
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, preexec_fn=preexec)  # noqa: PLW1509
