"""`python -m leanlm.parallel.worker`: a non-driver rank. It loads its slice as the driver does, then runs the
forward of every step the driver broadcasts until the driver says stop (exit 0); an error ends it with exit 1, and
the driver's process going away with SIGTERM (machine.spawn_child)."""

from __future__ import annotations

import logging
import os
import sys

import torch

from leanlm.engine import ModelRunner
from leanlm.parallel.driver import RANK_ENV, SPEC_ENV
from leanlm.parallel.rank import RankModel, RankSpec, build_rank, receive_plans, run_plans
from leanlm.parallel.world import close_world

logger = logging.getLogger("leanlm.parallel.worker")


def serve_steps(rank_model: RankModel) -> None:
    """Run the driver's steps on this rank until it sends None."""
    runner = ModelRunner(rank_model.model, rank_model.engine_config, rank_model.rank.device, rank_model.dtype)
    with torch.inference_mode():
        step = 0
        while (plans := receive_plans(rank_model.rank, step)) is not None:
            run_plans(rank_model, runner, plans)
            step += 1


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    spec = RankSpec.from_json(os.environ[SPEC_ENV])
    rank = int(os.environ.get(RANK_ENV) or os.environ["RANK"])  # ours, or torchrun's
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        serve_steps(build_rank(spec, rank))
    except Exception:
        logger.exception("rank %d failed", rank)
        return 1
    finally:
        close_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
