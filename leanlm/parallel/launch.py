"""Starting a parallel engine from LLM(...): spawned by LeanLM (a store on loopback, a fresh secret, one worker
process per other rank) or, when torchrun started this process (RANK/WORLD_SIZE in the environment), joined
through torchrun's rendezvous; there rank 0 returns the driver and every other rank serves the steps and exits."""

from __future__ import annotations

import atexit
import os
import secrets
import sys

import torch

from leanlm.config import EngineConfig
from leanlm.parallel.driver import SPEC_ENV, ParallelDriver
from leanlm.parallel.rank import RankSpec
from leanlm.parallel.world import LOOPBACK, serve_store


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start_driver(
    model: str, dtype: str | torch.dtype, device: torch.device, engine_config: EngineConfig, options: dict
) -> ParallelDriver:
    """The driver of tensor_parallel_size x pipeline_parallel_size ranks, its slice loaded and checked."""
    torchrun = under_torchrun()
    store, secret = None, None
    if torchrun:
        init_method = "env://"  # torchrun's store: the operator firewalls it (docs/parallelism.md)
    else:
        store, port = serve_store(engine_config.world_size, engine_config.parallel_timeout_s)
        init_method, secret = f"tcp://{LOOPBACK}:{port}", secrets.token_hex(32)
    spec = RankSpec.of(
        model,
        dtype,
        device,
        engine_config,
        attention_backend=options["attention_backend"],
        dequantize_gguf=options["dequantize_gguf"],
        init_method=init_method,
        secret=secret,
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
    driver = ParallelDriver(spec, progress=options["progress"], store=store)
    atexit.register(driver.close)
    return driver


def _serve_as_worker(spec: RankSpec) -> None:
    """Under torchrun, a rank other than 0 never returns from LLM(...): it serves the driver's steps, then exits."""
    from leanlm.parallel import worker

    os.environ[SPEC_ENV] = spec.to_json()
    sys.exit(worker.main())
