"""The replicas behind the data-parallel front: local `leanlm serve` processes it starts and stops, remote ones it
is given, their health (process exit, GET /health) and the per-replica counters the front's /metrics shows."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from leanlm.parallel.machine import spawn_child

logger = logging.getLogger("leanlm.router")

HEALTH_TIMEOUT_S = 5.0  # a replica that takes longer to answer /health is out of rotation until it answers again


def redact_url(url: str) -> str:
    """scheme://host:port of a replica URL: what the front shows without a key (/health, /metrics labels, its log).
    A --replicas URL may carry user:password, or a token in its path or query."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number: the URL never worked, nothing of it is shown
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


@dataclass
class Replica:
    """One replica and what the front counts about it. Mutated only on the front's event loop (and, before it
    runs, by the start-up wait)."""

    url: str  # its base URL, as given (it may hold credentials): the router's key for it
    process: subprocess.Popen | None = None  # a local replica's process; None for a remote one
    api_key: str | None = None  # the bearer key it expects
    is_healthy: bool = False  # in rotation
    is_dead: bool = False  # a local process that exited: never back in rotation
    num_in_flight: int = 0  # requests routed to it and not yet answered in full
    num_routed: int = 0
    num_failed: int = 0  # requests that broke on the way to or from it (not the 4xx/5xx it answered itself)
    num_prefix_hits: int = 0  # routed to it while it held at least one of the prompt's leading blocks

    @property
    def is_local(self) -> bool:
        return self.process is not None

    @property
    def name(self) -> str:
        """What the front shows of it (/health, the `replica` label of /metrics, the log): no credentials."""
        return redact_url(self.url)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def describe(self) -> dict:
        """Its entry in the front's /health, which answers without a key: no credentials, no pid."""
        state = "dead" if self.is_dead else "healthy" if self.is_healthy else "unhealthy"
        info = {"url": self.name, "state": state, "local": self.is_local, "in_flight": self.num_in_flight}
        if self.process is not None and self.process.returncode is not None:
            info["exit_status"] = self.process.returncode
        return info


def start_local(serve_args: list[str], port: int, threads: int, api_key: str, log_level: str) -> Replica:
    """`leanlm serve SERVE_ARGS` on 127.0.0.1:port with `threads` torch threads. Its API key goes through the
    environment (not the command line other users can read in ps); it trusts the front's X-Forwarded-For, so its
    per-client limit counts the front's clients, not the front."""
    command = [
        sys.executable,
        "-m",
        "leanlm.cli",
        "serve",
        *serve_args,
        *("--host", "127.0.0.1", "--port", str(port), "--threads", str(threads)),
        *("--forwarded-allow-ips", "127.0.0.1", "--log-level", log_level),
    ]
    env = {**os.environ, "LEANLM_API_KEY": api_key, "OMP_NUM_THREADS": str(threads)}
    env.pop("LEANLM_METRICS_KEY", None)  # /metrics takes the same key
    process = spawn_child(command, env)
    return Replica(f"http://127.0.0.1:{port}", process=process, api_key=api_key)


def _answers_health(replica: Replica, timeout_s: float) -> bool:
    request = urllib.request.Request(replica.url + "/health", headers=replica.headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):  # ValueError: urllib takes no user:password in a URL
        return False


def wait_until_ready(replicas: list[Replica], timeout_s: float, health_timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Block until every local replica answers /health (RuntimeError if one exits or the time runs out); remote ones
    get one look each and join the rotation when they answer (a remote one down now is not fatal)."""
    pending = [r for r in replicas if r.is_local]
    for replica in replicas:
        if not replica.is_local:
            replica.is_healthy = _answers_health(replica, health_timeout_s)
            if not replica.is_healthy:
                logger.warning("replica %s does not answer /health yet; it joins when it does", replica.name)
    deadline = time.monotonic() + timeout_s
    while pending:
        for replica in list(pending):
            status = replica.process.poll()
            if status is not None:
                raise RuntimeError(
                    f"local replica {replica.url} (pid {replica.process.pid}) exited with status {status} while "
                    "loading; its log is above"
                )
            if _answers_health(replica, 2.0):
                replica.is_healthy = True
                pending.remove(replica)
                logger.info("local replica %s (pid %d) is ready", replica.url, replica.process.pid)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(pending)} local replica(s) did not answer /health within {timeout_s:g} s; raise "
                "--replica-start-timeout-s or check their log above"
            )
        if pending:
            time.sleep(0.2)
    if not any(r.is_healthy for r in replicas):
        raise RuntimeError("no replica answers /health; start the --replicas or add local ones")


def stop_local(replicas: list[Replica], timeout_s: float = 30.0) -> None:
    """SIGTERM every live local replica (each drains its in-flight requests), then SIGKILL what is left."""
    live = [r.process for r in replicas if r.process is not None and r.process.poll() is None]
    for process in live:
        process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in live:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class HealthMonitor:
    """Takes replicas out of rotation (a local process exited, /health failed or took over `timeout_s`, a connection
    broke) and puts them back (a live one answers /health again). `on_down(replica)` runs on each removal (the router
    forgets it; the front moves or fails the requests it holds)."""

    def __init__(
        self, replicas: list[Replica], on_down: Callable[[Replica], None], timeout_s: float = HEALTH_TIMEOUT_S
    ) -> None:
        self.replicas = replicas
        self.on_down = on_down
        self.timeout_s = timeout_s

    def in_rotation(self) -> list[Replica]:
        return [r for r in self.replicas if r.is_healthy]

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Out of rotation (logged once per fall); a local replica whose process exited is dead for good."""
        is_newly_dead = replica.process is not None and replica.process.poll() is not None and not replica.is_dead
        if is_newly_dead:
            replica.is_dead = True
            reason = f"its process (pid {replica.process.pid}) exited with status {replica.process.returncode}"
        if replica.is_healthy or is_newly_dead:
            logger.error("replica %s is out of rotation: %s", replica.name, reason)
        if replica.is_healthy:
            replica.is_healthy = False
            self.on_down(replica)

    async def check(self, session: aiohttp.ClientSession) -> None:
        """One round of checks, all replicas at once."""
        await asyncio.gather(*(self._check_one(session, r) for r in self.replicas if not r.is_dead))

    async def _check_one(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        if replica.process is not None and replica.process.poll() is not None:
            self.mark_down(replica, "its process exited")
            return
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.get(replica.url + "/health", headers=replica.headers, timeout=timeout) as response:
                healthy, reason = response.status == 200, f"/health answered {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            healthy, reason = False, f"/health failed ({type(exc).__name__}: {exc})"
        if healthy and not replica.is_healthy:
            logger.info("replica %s answers /health: back in rotation", replica.name)
            replica.is_healthy = True
        elif not healthy:
            self.mark_down(replica, reason)

    async def run(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Check every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check(session)
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("health check round failed")
