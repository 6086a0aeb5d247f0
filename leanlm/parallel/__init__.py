"""Beyond one process, inside one engine: tensor, pipeline and expert parallelism on torch.distributed (gloo on
CPU, NCCL on GPU), each rank loading only its slices, and the step broadcast from the scheduler's rank. Serving
replicas behind a router is the fleet's job (leanlm/fleet/)."""
