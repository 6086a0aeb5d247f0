"""The process groups of one parallel engine: world ranks laid out as [pipeline stage][tensor rank], a tensor group
per stage, and a gloo control group for the step broadcast. Every collective has a timeout (parallel_timeout_s):
a rank that hangs fails the step. An idle engine runs no collective; its ranks wait on the rendezvous store for the
next step's key instead, which can wait for days."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leanlm.parallel.tensor import TensorGroup

DRIVER_RANK = 0  # the caller's process: it loads first, runs the scheduler and stage 0


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


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_rank(rank: int, layout: Layout, init_method: str, device: torch.device, timeout_s: float) -> RankContext:
    """Join the world (init_method: tcp://host:port, or env:// under torchrun) and build every group; all ranks call
    this with the same layout. On CUDA, rank r drives cuda:(r mod device count)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one tensor/pipeline-parallel engine per "
            "process; close the other LLM first (LLM.close())"
        )
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=layout.world_size, timeout=timeout
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    # torch keeps the store init_process_group rendezvoused through (ours, or torchrun's) only privately
    store = dist.PrefixStore("leanlm/steps/", dist.distributed_c10d._get_default_store())
    tp = TensorGroup(layout.tensor_rank_of(rank), layout.tensor_parallel_size, None)
    for stage in range(layout.pipeline_parallel_size):  # every rank creates every group, in the same order
        ranks = [layout.rank_at(stage, t) for t in range(layout.tensor_parallel_size)]
        group = dist.new_group(ranks, timeout=timeout) if layout.tensor_parallel_size > 1 else None
        if stage == layout.stage_of(rank):
            tp = TensorGroup(layout.tensor_rank_of(rank), layout.tensor_parallel_size, group)
    return RankContext(rank, layout, tp, control, store, device, timeout_s)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
