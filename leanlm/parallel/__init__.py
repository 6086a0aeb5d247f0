"""Beyond one process: tensor and pipeline parallelism on torch.distributed (gloo on CPU, NCCL on GPU), the
step broadcast from the scheduler's rank, and data-parallel replicas behind a cache-aware router (plain HTTP
between ordinary `leanlm serve` processes)."""
