"""Replica health: the monitor takes a replica out when /health fails and back when it answers again."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from leanlm.fleet.replicas import HealthMonitor, Replica, wait_until_ready
from leanlm.parallel.machine import cores_per_process, free_port
from tests.server.conftest import serve_engine


def test_default_threads_share_the_cpus():
    cpus = len(os.sched_getaffinity(0))
    assert cores_per_process(1) == cpus
    assert cores_per_process(cpus * 4) == 1
    assert cores_per_process(0) == cpus


def test_monitor_takes_a_failing_replica_out_and_back(make_tiny_engine):
    engine = make_tiny_engine(kv_cache_memory_bytes=8 << 20)
    with serve_engine(engine) as server:
        live, gone = Replica(server.url), Replica(f"http://127.0.0.1:{free_port()}")
        wait_until_ready([live, gone], timeout_s=10)
        assert (live.is_healthy, gone.is_healthy) == (True, False)
        forgotten = []
        monitor = HealthMonitor([live, gone], on_down=lambda replica: forgotten.append(replica.url))

        async def check() -> None:
            async with aiohttp.ClientSession() as session:
                await monitor.check(session)

        asyncio.run(check())
        assert monitor.in_rotation() == [live]
        live.is_healthy = False  # as after a broken connection: the next answer to /health brings it back
        asyncio.run(check())
        assert monitor.in_rotation() == [live]
        monitor.mark_down(live, "test")
        assert forgotten == [live.url] and monitor.in_rotation() == []
    with pytest.raises(RuntimeError, match="no replica answers /health"):
        wait_until_ready([Replica(f"http://127.0.0.1:{free_port()}")], timeout_s=1)
