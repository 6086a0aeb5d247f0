"""Small-M linear kernels on this CPU: bf16 (cpu_gemv) vs int8 / int4 (cpu_qgemv) vs torch's int8/int4 ops.

Times each kernel on SmolLM2-135M's matrix shapes (weights hot in cache after the first call) and on a
whole-model chain that cycles through 30 layers' worth of distinct matrices (210, about 212 MB in bf16),
so weights stream from DRAM as in real decode. GB/s counts the bytes a kernel must read: weight codes
plus scales/mins (fp32 for ours, bf16 for torch's).

    PYTHONPATH=. python benchmarks/qgemv.py --threads 2
    PYTHONPATH=. python benchmarks/qgemv.py --threads 1 --clock cpu   # on a machine others keep busy

Each call also pays ~5 us of Python + ctypes + allocation: most of the small matrices' time, and about
1 ms of the chain's 210 calls. The last line says how busy other processes kept the machine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from leanlm.analysis.host import describe_machine
from leanlm.kernels import cpu_gemv, cpu_qgemv

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # (N, K)
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o g u d
GROUP = 64


def make_weights(N: int, K: int, seed: int) -> dict:
    """One matrix in every format: {name: (callable(x) -> y, bytes read per call)}."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16)
    # int8, symmetric per channel
    s8 = w.float().abs().amax(1).clamp_min(1e-8) / 127
    q8 = (w.float() / s8[:, None]).round().clamp(-128, 127).to(torch.int8)
    s8_bf16 = s8.to(torch.bfloat16)
    # int4, asymmetric per group: codes 0..15, w = q * scale + min
    wg = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s4 = ((hi - lo) / 15).clamp_min(1e-8)
    codes = ((wg - lo[..., None]) / s4[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    q4 = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    mins = lo.contiguous()
    # torch's tinygemm layout: w = (q - 8) * scale + zero, scale/zero [K / group, N, 2] bf16
    t4 = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    t4_sz = torch.stack([s4, lo + 8 * s4], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    G = K // GROUP
    return {
        "bf16": (lambda x: cpu_gemv.linear_bf16(x, w), N * K * 2),
        "int8": (lambda x: cpu_qgemv.linear_int8(x, q8, s8), N * K + N * 4),
        "int4 g64": (lambda x: cpu_qgemv.linear_int4(x, q4, s4, mins, GROUP), N * K // 2 + N * G * 8),
        "torch int8": (lambda x: torch._weight_int8pack_mm(x, q8, s8_bf16), N * K + N * 2),
        "torch int4 g64": (lambda x: torch._weight_int4pack_mm_for_cpu(x, t4, GROUP, t4_sz), N * K // 2 + N * G * 4),
    }


def time_calls(calls, min_seconds: float, repeats: int = 7, clock=time.perf_counter) -> float:
    """Seconds one pass over `calls` takes: the fastest of `repeats` timings of >= min_seconds each. The
    fastest, not the median: on a shared 2-core machine another process's time slice stalls an OpenMP
    barrier for milliseconds, which says nothing about the kernel."""
    for fn, x in calls:  # warm up (and build the kernels)
        fn(x)
    samples = []
    for _ in range(repeats):
        n, start = 0, clock()
        while True:
            for fn, x in calls:
                fn(x)
            n += 1
            elapsed = clock() - start
            if elapsed >= min_seconds:
                break
        samples.append(elapsed / n)
    return min(samples)


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # idle and iowait are not busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--min-seconds", type=float, default=0.05)
    parser.add_argument("--chain-only", action="store_true")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time (needs --threads 1), which leaves out time slices lost "
        "to other processes on a busy machine (not their share of memory bandwidth)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    busy0, total0 = cpu_ticks()
    ours0 = sum(os.times()[:2])
    names = list(make_weights(64, 128, 0))
    print(f"threads={args.threads}  clock={args.clock}  torch {torch.__version__}  (time per call, effective GB/s)")
    header = "| M | matrix (N, K) | " + " | ".join(names) + " |"
    print(header + "\n|" + "---|" * (2 + len(names)))

    for M in [] if args.chain_only else args.rows:
        for N, K in SHAPES:
            weights = make_weights(N, K, seed=1)
            x = torch.randn(M, K).to(torch.bfloat16)
            cells = []
            for name in names:
                fn, nbytes = weights[name]
                t = time_calls([(fn, x)], args.min_seconds, clock=clock)
                cells.append(f"{t * 1e6:.1f} us, {nbytes / t / 1e9:.1f} GB/s")
            print(f"| {M} | ({N}, {K}) | " + " | ".join(cells) + " |", flush=True)

    chain = [make_weights(N, K, seed=i) for i in range(args.layers) for N, K in LAYER]
    shapes = [s for _ in range(args.layers) for s in LAYER]
    for M in args.rows:
        xs = {K: torch.randn(M, K).to(torch.bfloat16) for K in {K for _, K in LAYER}}
        cells = []
        for name in names:
            calls = [(weights[name][0], xs[K]) for weights, (_, K) in zip(chain, shapes)]
            nbytes = sum(weights[name][1] for weights in chain)
            t = time_calls(calls, args.min_seconds * 3, clock=clock)
            cells.append(f"{t * 1e3:.2f} ms, {nbytes / t / 1e9:.1f} GB/s")
        print(f"| {M} | chain: {len(chain)} matrices | " + " | ".join(cells) + " |", flush=True)
    print(f"machine: {describe_machine()}")
    busy1, total1 = cpu_ticks()
    ours = (sum(os.times()[:2]) - ours0) * os.sysconf("SC_CLK_TCK")
    print(f"other processes kept {max(0.0, (busy1 - busy0 - ours) / (total1 - total0)):.0%} of the CPUs busy")


if __name__ == "__main__":
    main()
