"""Decode speed of the bundled SmolLM2-135M-Instruct on a quiet and on a busy machine, for each thread policy:
automatic (the default: the cores other processes leave free, leanlm.engine.threads), one thread, every core.

    python benchmarks/threads_contention.py --out docs/threads.md

The busy machine is `--load` pure-Python busy loops per core (load 3 per core by default: 6 on 2 cores), started
before each repetition and stopped after it. Each repetition records the CPU share other processes took
(/proc/stat): on the quiet machine a repetition above --max-other-cpu is discarded; on the busy one it is the load.
Run it without OMP_NUM_THREADS set (it would fix the automatic policy's count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from leanlm import LLM, SamplingParams
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.engine.threads import usable_cores
from leanlm.loading.registry import DEFAULT_MODEL

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def decode_rate(llm: LLM, num_tokens: int) -> float:
    """Decode tokens/s of one greedy request of `num_tokens` tokens (its metrics: prefill left out)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    metrics = llm.generate(["The history of the city begins"], params, use_tqdm=False)[0].metrics
    return (num_tokens - 1) / (metrics.finished_time - metrics.first_token_time)


def busy_loops(count: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)]) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--load", type=int, default=3, help="busy loops per core on the busy machine")
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--out", default=None, help="markdown file whose threads-contention section is rewritten")
    args = ap.parse_args()
    if os.environ.get("OMP_NUM_THREADS"):
        sys.exit("unset OMP_NUM_THREADS: it fixes the automatic policy's thread count")
    cores = usable_cores()
    policies = {"automatic (default)": None, "--threads 1": 1, f"--threads {cores}": cores}
    rows = []
    for name, threads in policies.items():
        llm = LLM(DEFAULT_MODEL, dtype="auto", progress=False, num_threads=threads)
        decode_rate(llm, 8)  # warm-up: kernels, allocator
        for machine in ("quiet", "busy"):
            rates, shares, discarded = [], [], 0
            for _ in range(args.reps):
                loops = busy_loops(args.load * cores, 600) if machine == "busy" else []
                try:
                    time.sleep(0.3 if loops else 0)  # the loops are running before we start
                    with CpuMonitor() as monitor:
                        rate = decode_rate(llm, args.tokens)
                finally:
                    for p in loops:
                        p.kill()
                        p.wait()
                share = monitor.sample.other_share
                if machine == "quiet" and share > args.max_other_cpu:
                    discarded += 1
                    continue
                rates.append(rate)
                shares.append(share)
            median = statistics.median(rates) if rates else float("nan")
            rows.append((name, machine, median, shares, discarded, llm.llm_engine.layout().num_threads, str(llm.dtype)))
            print(rows[-1], flush=True)
    write(rows, args, cores)


def write(rows, args, cores: int) -> None:
    lines = [
        f"Machine: {describe_machine()}. Command: `python benchmarks/threads_contention.py"
        f"{' --tokens ' + str(args.tokens)}{' --reps ' + str(args.reps)}{' --out ' + args.out if args.out else ''}`. "
        f"SmolLM2-135M-Instruct (its Q4_1 GGUF on its 4-bit codes, {rows[0][6].removeprefix('torch.')} activations as "
        f"dtype auto picked on this CPU), batch 1, {args.tokens} greedy tokens, median decode tokens/s of {args.reps} "
        f"repetitions. Busy: {args.load * cores} busy loops on {cores} cores (load {args.load * cores}).",
        "",
        "| threads | machine | decode tok/s | other processes' CPU share per repetition | threads at the end |",
        "|---|---|---|---|---|",
    ]
    for name, machine, median, shares, discarded, threads, _ in rows:
        kept = ", ".join(f"{s:.0%}" for s in shares) + (f" ({discarded} discarded)" if discarded else "")
        lines.append(f"| {name} | {machine} | {median:.1f} | {kept} | {threads} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        replace_section(Path(args.out), "threads-contention", text)


if __name__ == "__main__":
    main()
