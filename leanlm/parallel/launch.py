"""Starting a parallel engine from LLM(...): spawned by LeanLM (a free loopback port, one worker process per
other rank) or, when torchrun started this process (RANK/WORLD_SIZE in the environment), joined through torchrun's
rendezvous; there rank 0 returns the driver and every other rank serves the steps and exits."""

from __future__ import annotations

import atexit
import os
import sys

import torch

from leanlm.config import EngineConfig
from leanlm.parallel.driver import SPEC_ENV, ParallelDriver
from leanlm.parallel.machine import free_port
from leanlm.parallel.rank import RankSpec


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start_driver(
    model: str, dtype: str | torch.dtype, device: torch.device, engine_config: EngineConfig, options: dict
) -> ParallelDriver:
    """The driver of tensor_parallel_size x pipeline_parallel_size ranks, its slice loaded and checked."""
    torchrun = under_torchrun()
    init_method = "env://" if torchrun else f"tcp://127.0.0.1:{free_port()}"
    spec = RankSpec.of(
        model,
        dtype,
        device,
        engine_config,
        attention_backend=options["attention_backend"],
        gguf_codes=options["gguf_codes"],
        init_method=init_method,
    )
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if world != engine_config.world_size:
            raise ValueError(
                f"torchrun started {world} processes but tensor_parallel_size x pipeline_parallel_size is "
                f"{engine_config.world_size}; make them equal (torchrun --nproc-per-node {engine_config.world_size})"
            )
        if int(os.environ["RANK"]) != 0:
            _serve_as_worker(spec)
    driver = ParallelDriver(spec, progress=options["progress"])
    atexit.register(driver.close)
    return driver


def _serve_as_worker(spec: RankSpec) -> None:
    """Under torchrun, a rank other than 0 never returns from LLM(...): it serves the driver's steps, then exits."""
    from leanlm.parallel import worker

    os.environ[SPEC_ENV] = spec.to_json()
    sys.exit(worker.main())
