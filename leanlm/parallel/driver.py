"""The driver: rank 0 of a parallel engine, in the caller's process. It starts the other ranks (or joins the ones
torchrun started), loads its own slice, and runs each step by broadcasting the plans and its part of the forward.
A rank that exits, hangs past parallel_timeout_s or fails raises EngineDeadError: the engine stops, never hangs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import DistError

from leanlm.engine import EngineDeadError, LLMEngine, ModelRunner, StepOutput, StepPlan
from leanlm.parallel.machine import cores_per_process, spawn_child
from leanlm.parallel.rank import RankModel, RankSpec, build_rank, run_plans, send_plans
from leanlm.parallel.world import DRIVER_RANK, close_world

logger = logging.getLogger(__name__)

SPEC_ENV = "LEANLM_RANK_SPEC"  # a worker's RankSpec, as JSON
RANK_ENV = "LEANLM_RANK"  # a worker's rank


def spawn_workers(spec: RankSpec) -> list[subprocess.Popen]:
    """Ranks 1..world-1 as `python -m leanlm.parallel.worker`, each with its share of the cores."""
    world = spec.layout.world_size
    env = dict(os.environ, **{SPEC_ENV: spec.to_json(), "OMP_NUM_THREADS": str(rank_threads(spec))})
    command = [sys.executable, "-m", "leanlm.parallel.worker"]
    return [spawn_child(command, dict(env, **{RANK_ENV: str(rank)})) for rank in range(1, world)]


def rank_threads(spec: RankSpec) -> int:
    """Threads each rank computes on: --threads, or this process's cores shared out over the local ranks."""
    return spec.engine.get("num_threads") or cores_per_process(spec.layout.world_size)


class ParallelDriver:
    """Rank 0's side of the engine: `forward(plans)` is the model runner's step_forward."""

    def __init__(self, spec: RankSpec, progress: bool = True, store: dist.Store | None = None) -> None:
        """`store`: the one a local world's workers join (world.serve_store; spec.init_method names its port);
        None under torchrun."""
        self.spec = spec
        self.workers: list[subprocess.Popen] = []
        self.closed = False
        if store is not None:
            self.workers = spawn_workers(spec)
        self.caller_threads = torch.get_num_threads()  # given back by close()
        torch.set_num_threads(rank_threads(spec))
        try:
            self.rank_model: RankModel = build_rank(spec, DRIVER_RANK, progress, store, self.check_workers)
        except BaseException:
            for p in self.workers:  # they may wait on a collective this rank will never join
                p.terminate()
            self._stop_workers()
            close_world()
            torch.set_num_threads(self.caller_threads)
            raise
        self.num_steps = 0  # steps broadcast so far: the next one's number

    def attach(self, engine: LLMEngine) -> None:
        """Make `engine` (built over this rank's slice) run its steps through every rank."""
        layout = self.spec.layout
        microbatches = self.rank_model.engine_config.pipeline_microbatches or layout.pipeline_parallel_size
        engine.set_step_forward(self.forward, microbatches if layout.pipeline_parallel_size > 1 else 1)

    def forward(self, runner: ModelRunner, plans: list[StepPlan]) -> list[StepOutput]:
        """The step on every rank: announce and broadcast the plans, then run this rank's part on `runner`."""
        if self.closed:
            raise EngineDeadError("the parallel engine was closed; create a new LLM")
        self.check_workers()
        try:
            send_plans(self.rank_model.rank, self.num_steps, plans)
            self.num_steps += 1
            return run_plans(self.rank_model, runner, plans)
        except (RuntimeError, DistError) as exc:  # gloo/NCCL: a peer closed its connection, or a timeout
            # a killed rank's sockets close before the kernel reaps it: give its exit a moment to become visible
            self.check_workers(grace_s=2.0)
            self.closed = True  # the groups are in an unknown state: no collective may run on them again
            raise EngineDeadError(
                f"a collective between the ranks failed ({type(exc).__name__}: {exc}); a rank died or hung for "
                f"longer than parallel_timeout_s={self.rank_model.engine_config.parallel_timeout_s}"
            ) from exc

    def check_workers(self, grace_s: float = 0.0) -> None:
        """Raise EngineDeadError if a worker this driver started has exited (waiting up to `grace_s` for one)."""
        deadline = time.monotonic() + grace_s
        while grace_s > 0 and all(p.poll() is None for p in self.workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.workers) if p.poll() is not None]
        if dead:
            self.closed = True
            ranks = ", ".join(f"rank {r} (exit status {code})" for r, code in dead)
            raise EngineDeadError(f"{ranks} of the parallel engine exited; see its log above. Restart the engine")

    def close(self, timeout_s: float = 30.0) -> None:
        """Tell every rank to stop, wait for them, leave the process group. Idempotent."""
        if self.closed and not self.workers:
            return
        try:
            if not self.closed and all(p.poll() is None for p in self.workers):
                send_plans(self.rank_model.rank, self.num_steps, None)
        except (RuntimeError, DistError):
            logger.warning("a rank did not take the shutdown message; stopping it")
        finally:
            self.closed = True
            self._stop_workers(timeout_s)
            close_world()
            torch.set_num_threads(self.caller_threads)

    def _stop_workers(self, timeout_s: float = 30.0) -> None:
        for p in self.workers:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.workers = []
