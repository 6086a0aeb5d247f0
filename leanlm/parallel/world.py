"""The process groups of one parallel engine: world ranks laid out as [pipeline stage][tensor rank], a tensor group
per stage, and a gloo control group for the step broadcast. Every collective has a timeout (parallel_timeout_s):
a rank that hangs fails the step. An idle engine runs no collective; its ranks wait on the rendezvous store for the
next step's key instead, which can wait for days.

A local world (LeanLM spawned the workers) listens on loopback only, its store and gloo alike, and its ranks hold a
shared secret: each proves it when the world forms (rank.check_agreement), and the store key that wakes the workers
for a step is named by it, so a process that reaches the store without it can neither join nor announce a step."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leanlm.parallel.tensor import TensorGroup

DRIVER_RANK = 0  # the caller's process: it loads first, runs the scheduler and stage 0
LOOPBACK = "127.0.0.1"
# How long ranks wait for each other to start and to load, whatever parallel_timeout_s (which bounds collectives):
# a worker first imports torch and reads the checkpoint, which on a busy machine or a large model takes far longer
# than a step may. A rank that exits meanwhile ends the wait at once (wait_for_ranks' check_peers).
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Layout:
    """tensor_parallel_size x pipeline_parallel_size ranks; rank = stage * tensor_parallel_size + tensor rank."""

    tensor_parallel_size: int
    pipeline_parallel_size: int

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"parallel sizes must be >= 1, got {self}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tensor_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank_at(self, stage: int, tensor_rank: int) -> int:
        return stage * self.tensor_parallel_size + tensor_rank


@dataclass(frozen=True)
class RankContext:
    """This process's place in the engine and the groups it talks through."""

    rank: int
    layout: Layout
    tp: TensorGroup  # the ranks of this stage
    control: dist.ProcessGroup | None  # gloo, every rank: the step broadcast and startup checks (None: one process)
    store: dist.Store | None  # the rendezvous store: the driver announces each step there before broadcasting it
    device: torch.device
    timeout_s: float
    secret: str | None = None  # the world's shared secret (hex); None under torchrun, whose operator firewalls it

    def step_key(self, step: int) -> str:
        """The store key that announces step `step`: without the secret, nobody can name a future step's key."""
        return self.proof(f"step/{step}") if self.secret else str(step)

    def proof(self, message: str) -> str:
        """HMAC-SHA256 of `message` under the secret ("" without one)."""
        return proof(self.secret, message)

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pipeline_parallel_size - 1

    def peer(self, stage: int) -> int:
        """The rank of `stage` that holds this rank's tensor slice (hidden states pass between such ranks)."""
        return self.layout.rank_at(stage, self.tp.rank)


def proof(secret: str | None, message: str) -> str:
    """HMAC-SHA256 of `message` under `secret` (hex; "" without one)."""
    if not secret:
        return ""
    return hmac.new(bytes.fromhex(secret), message.encode(), hashlib.sha256).hexdigest()


def wait_for_ranks(
    store: dist.Store,
    rank: int,
    world_size: int,
    stage: str,
    secret: str | None = None,
    check_peers: Callable[[], None] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> None:
    """Announce on the store that `rank` reached `stage` of start-up, then wait for every other rank to announce it
    too: up to `timeout_s`, asking `check_peers` (which raises if a rank's process has exited) as it polls. Keys are
    named by the secret where there is one, as the step keys are. (Polled with check, not a blocking wait: c10d logs
    a warning for every wait that times out.)"""

    def key(r: int) -> str:
        return f"leanlm/start/{proof(secret, f'{stage}/{r}') or f'{stage}/{r}'}"

    store.set(key(rank), b"1")
    others = [key(r) for r in range(world_size) if r != rank]
    deadline = time.monotonic() + timeout_s
    while not store.check(others):
        if check_peers is not None:
            check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: the other ranks did not reach '{stage}' of start-up within {timeout_s:.0f} s; "
                "see their log above (a worker that cannot import LeanLM or read the checkpoint?)"
            )
        time.sleep(0.02)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def serve_store(world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The driver's rendezvous store of a local world and its port, listening on loopback only. torch's TCPStore
    binds every interface (*:port) whatever host it is given, so the socket is bound here and handed over."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns (and closes) the descriptor from here on
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            LOOPBACK, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return store, port


def join_store(init_method: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A worker's client of the driver's store at init_method (tcp://127.0.0.1:PORT)."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


@contextlib.contextmanager
def _gloo_on_loopback() -> Iterator[None]:
    """gloo opens its listening sockets on the interface GLOO_SOCKET_IFNAME names when a group is created (default:
    the address the host name resolves to, often the LAN's); set to loopback only meanwhile."""
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved


def init_rank(
    rank: int,
    layout: Layout,
    device: torch.device,
    timeout_s: float,
    store: dist.Store | None = None,
    secret: str | None = None,
) -> RankContext:
    """Join the world and build every group; all ranks call this with the same layout. A local world passes its
    `store` (serve_store, join_store) and `secret`, and its groups listen on loopback; store None joins through
    torchrun's env:// rendezvous. On CUDA, rank r drives cuda:(r mod device count)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one tensor/pipeline-parallel engine per "
            "process; close the other LLM first (LLM.close())"
        )
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    world = dict(rank=rank, world_size=layout.world_size, timeout=timeout)
    # torch names the default group by a per-process counter that only destroy_process_group resets, so a start that
    # failed inside init_process_group would leave this process naming its groups differently from fresh workers
    # (each waiting for keys the other never writes): start from the name a fresh process uses.
    if hasattr(dist.distributed_c10d, "_world"):
        dist.distributed_c10d._world.group_count = 0
    with _gloo_on_loopback() if store is not None else contextlib.nullcontext():
        if store is not None:
            if device.type == "cuda":
                # NCCL reads it once, at its first communicator (lazily, after this block): it cannot be scoped
                os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
            dist.init_process_group(backend_for(device), store=store, **world)
        else:
            dist.init_process_group(backend_for(device), init_method="env://", **world)
            # torch keeps the store torchrun's rendezvous went through only privately
            store = dist.distributed_c10d._get_default_store()
        control = dist.new_group(backend="gloo", timeout=timeout)
        tp = TensorGroup(layout.tensor_rank_of(rank), layout.tensor_parallel_size, None)
        for stage in range(layout.pipeline_parallel_size):  # every rank creates every group, in the same order
            ranks = [layout.rank_at(stage, t) for t in range(layout.tensor_parallel_size)]
            group = dist.new_group(ranks, timeout=timeout) if layout.tensor_parallel_size > 1 else None
            if stage == layout.stage_of(rank):
                tp = TensorGroup(layout.tensor_rank_of(rank), layout.tensor_parallel_size, group)
    steps = dist.PrefixStore("leanlm/steps/", store)
    return RankContext(rank, layout, tp, control, steps, device, timeout_s, secret)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
