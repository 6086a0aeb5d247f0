"""Fine-tuning, learned sparsity, QAT, early-exit heads and distillation, to a token budget, resumably; built on
leanlm.compress. Entry points: run(TrainJob) and run_distill(DistillJob)."""

from leanlm.train.job import DistillJob, TrainJob, build_sparsity
from leanlm.train.workflow import TrainReport, run, run_distill

__all__ = ["DistillJob", "TrainJob", "TrainReport", "build_sparsity", "run", "run_distill"]
