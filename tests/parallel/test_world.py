"""A local parallel world on the network: while a TP=2 engine (or server) runs, every socket its processes listen on
is a loopback one (the store and gloo; the server's HTTP port aside), a client that reaches the store without the
world's secret can neither make a worker enter a broadcast nor take a rank's place, and the engine serves on
unharmed."""

from __future__ import annotations

import datetime
import ipaddress
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from leanlm import LLM, SamplingParams
from leanlm.parallel.world import Layout, init_rank, join_store, serve_store
from tests.server.test_lifecycle import _free_port, _wait_healthy

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], [400, 12]]


def _listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket the processes `pids` listen on, from /proc/net/tcp and tcp6."""
    inodes: dict[str, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16), inodes[inode]))
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_a_tp2_world_listens_on_loopback_only_and_ignores_a_client_without_the_secret(parallel_checkpoints):
    timeout_s = 10  # a worker lured into a broadcast the driver never sends would die after this (and starts within)
    llm = LLM(parallel_checkpoints["dense"], dtype="float32", progress=False, tensor_parallel_size=2,
              parallel_timeout_s=timeout_s)  # fmt: skip
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        driver = llm.parallel
        pids = [os.getpid(), *(p.pid for p in driver.workers)]
        store_port = int(driver.spec.init_method.rsplit(":", 1)[1])
        sockets = _listening(pids)
        assert store_port in {port for _, port, _ in sockets}  # the store is among what we look at
        assert {pid for _, _, pid in sockets} >= set(pids[1:])  # and so are the worker's gloo listeners
        assert [s for s in sockets if not _is_loopback(s[0])] == []

        # A client of the store: it lists the keys, replays them, and announces later steps by counting on from
        # every key that ends in a number (the old step keys did: default_pg/leanlm/steps/N).
        intruder = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=10))
        seen = intruder.list_keys()
        assert seen  # the store holds the rendezvous' keys, and the current step's
        assert not any(driver.spec.secret in key for key in seen)
        for key in seen:
            intruder.set(key, intruder.get(key))
            if counted := re.search(r"\d+$", key):
                for later in range(int(counted[0]) + 1, int(counted[0]) + 5):
                    intruder.set(key[: counted.start()] + str(later), b"")
        time.sleep(timeout_s + 2)  # long enough for a lured worker's broadcast to time out and kill it
        assert all(p.poll() is None for p in driver.workers)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        llm.close()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_a_tp2_server_on_every_interface_listens_beyond_loopback_on_its_http_port_only(parallel_checkpoints):
    """`leanlm serve --host 0.0.0.0 --tensor-parallel-size 2`: of every socket the server and its rank listen on,
    only the HTTP port is not a loopback one."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "leanlm.cli",
        "serve",
        "--model",
        parallel_checkpoints["dense"],
        "--host",
        "0.0.0.0",
    ]
    command += ["--port", str(port), "--api-key", "k", "--tensor-parallel-size", "2", "--dtype", "float32"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        pids = [server.pid, *(child.pid for child in psutil.Process(server.pid).children(recursive=True))]
        sockets = _listening(pids)
        assert len(pids) == 2 and {pid for _, _, pid in sockets} == set(pids)
        assert [(address, p) for address, p, _ in sockets if not _is_loopback(address)] == [("0.0.0.0", port)]
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def _rank(rank: int, given: tuple[str, dict], ports, answers) -> None:
    """Join a two-rank world with secret `given[0]`, check agreement on facts `given[1]`; answer "joined" or the
    refusal."""
    secret, facts = given
    layout = Layout(2, 1)
    if rank == 0:
        store, port = serve_store(2, 20)
        ports.put(port)
    else:
        store = join_store(f"tcp://127.0.0.1:{ports.get(timeout=60)}", 2, 20)
    context = init_rank(rank, layout, torch.device("cpu"), 20, store, secret)
    from leanlm.parallel.rank import check_agreement

    try:
        check_agreement(context, facts)
        answers.put((rank, "joined"))
    except (PermissionError, ValueError) as exc:
        answers.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def _two_ranks(target, args: tuple) -> dict:
    """Spawn ranks 0 and 1 running target(rank, args[rank], ports, answers); each rank's answer, by rank."""
    spawn = multiprocessing.get_context("spawn")
    ports, answers = spawn.Queue(), spawn.Queue()
    ranks = [spawn.Process(target=target, args=(r, arg, ports, answers)) for r, arg in enumerate(args)]
    for process in ranks:
        process.start()
    try:
        return dict(answers.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()


def test_a_process_without_the_secret_cannot_take_a_ranks_place():
    """Rank 1 reached the store first but holds another secret: both ranks refuse to start, each naming the other
    (rank 1 cannot tell the impostor from the driver: it only knows that they differ)."""
    got = _two_ranks(_rank, (("aa" * 32, {"model": "same"}), ("bb" * 32, {"model": "same"})))
    assert "rank(s) [1] did not prove the engine's secret" in got[0]
    assert "rank(s) [0] did not prove the engine's secret" in got[1]


def test_a_rank_whose_checkpoint_fingerprint_differs_makes_every_rank_refuse():
    """A different file on one host (formats/fingerprint.py: headers, sizes, sampled data): both ranks refuse before
    reading a weight, naming rank 1's checkpoint."""
    facts = ({"model": "same", "checkpoint": "ab"}, {"model": "same", "checkpoint": "cd"})
    got = _two_ranks(_rank, tuple(("cc" * 32, f) for f in facts))
    for r in (0, 1):
        assert "did not load the same model: rank 1's checkpoint differ" in got[r]
