"""Hardware profiles for the roofline: peak dense matmul FLOP/s, memory bandwidth and capacity; built-in
datasheet numbers for A100/H100/H200, or this machine measured (`measure_hardware`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from leanlm.analysis.host import measure_memory_bandwidth


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or this CPU). FLOP/s are dense (no 2:4 sparsity), bandwidth is bytes/s."""

    name: str
    peak_flops: float  # bf16/fp16 matmul FLOP/s: what a weight-only quantized model computes in too
    peak_flops_fp32: float  # fp32 matmul FLOP/s (TF32 tensor cores on GPUs)
    memory_bandwidth: float  # bytes/s, HBM or DRAM
    memory_bytes: int  # capacity
    source: str  # where the numbers come from

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.peak_flops_fp32, self.memory_bandwidth) <= 0 or self.memory_bytes < 1:
            raise ValueError(
                f"hardware {self.name!r} needs positive peak_flops, peak_flops_fp32, memory_bandwidth and memory_bytes"
            )

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s of the matmuls for weights stored as `dtype` (quantized weights compute in bf16)."""
        return self.peak_flops_fp32 if dtype == "fp32" else self.peak_flops

    @property
    def ridge_point(self) -> float:
        """FLOP/byte where the roofline turns: below it a kernel is memory bound, above compute bound."""
        return self.peak_flops / self.memory_bandwidth


# NVIDIA datasheets; FLOP/s are the dense tensor-core numbers (the datasheets' larger figures assume 2:4
# sparsity), fp32 is TF32 dense.
HARDWARE: dict[str, Hardware] = {
    # A100 80GB SXM: 312 TFLOP/s bf16, 156 TFLOP/s TF32, 2,039 GB/s HBM2e ("A100 datasheet", 2021).
    "a100": Hardware("A100 80GB SXM", 312e12, 156e12, 2.039e12, 80 * 10**9, "NVIDIA A100 datasheet, dense"),
    # H100 SXM5 80GB: 989 TFLOP/s bf16, 494 TFLOP/s TF32, 3.35 TB/s HBM3 ("H100 datasheet", 2023).
    "h100": Hardware("H100 SXM 80GB", 989e12, 494e12, 3.35e12, 80 * 10**9, "NVIDIA H100 datasheet, dense"),
    # H200 SXM 141GB: the H100 compute with 4.8 TB/s HBM3e ("H200 datasheet", 2024).
    "h200": Hardware("H200 SXM 141GB", 989e12, 494e12, 4.8e12, 141 * 10**9, "NVIDIA H200 datasheet, dense"),
}


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of an n x n x n matmul (2 n^3 FLOPs) in `dtype` on `device`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm up (kernel selection, thread pool)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _measure_cuda_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device="cuda")
    x.sum()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_hardware(device: torch.device | None = None) -> Hardware:
    """This machine (its GPU when CUDA is present, else the CPU): read bandwidth and matmul FLOP/s, measured."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, memory, bandwidth, n = props.name, props.total_memory, _measure_cuda_bandwidth(), 8192
    else:
        from leanlm.analysis.host import cpu_name

        name, memory, bandwidth, n = cpu_name(), _ram_bytes(), measure_memory_bandwidth(), 1024
    return Hardware(
        name=f"this machine: {name}",
        peak_flops=measure_matmul_flops(torch.bfloat16, device, n),
        peak_flops_fp32=measure_matmul_flops(torch.float32, device, n),
        memory_bandwidth=bandwidth,
        memory_bytes=memory,
        source=f"measured: best of 5 {n}x{n} matmuls, read bandwidth of a {'1 GiB' if n > 1024 else '256 MiB'} sum",
    )
