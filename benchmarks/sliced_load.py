"""Peak resident memory per rank when each rank loads only its slice (issue 51): one process against TP=2 ranks and
PP=2 stages (and, for an MoE, TP=2 with expert parallelism), each run in its own process tree while this script
polls every process's VmHWM (/proc/PID/status: the high-water mark of its resident memory, mapped file pages
included). Every layout's greedy tokens are checked against one process's. Writes a markdown table.

    python benchmarks/sliced_load.py --results docs/parallelism_results.md

It replaces (or appends) its own section of that file, from SECTION on; parallel_bench.py keeps it when it rewrites
the rest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# Four prompts of 64 greedy tokens each: enough steps that every expert of the MoE is routed to, so that one
# process's memory-mapped weights are all resident, as they are in a server's steady state (8 tokens of one prompt
# leave some experts' pages unread, which flatters one process: 2.75 GB against 3.10 GB after this workload)
PROMPTS = ["def quicksort(xs):", "The history of Rome", "Once upon a time", "import numpy as np"]
MAX_TOKENS = 64
SECTION = "## Each rank loads only its slice"
KV_BYTES = 64 << 20  # a small KV pool on every rank: the table measures the weights
LAYOUTS = {
    "one process": {},
    "TP=2": {"tensor_parallel_size": 2},
    "PP=2": {"pipeline_parallel_size": 2},
}
MOE_LAYOUTS = {**LAYOUTS, "TP=2, expert parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}


def child(job: dict) -> None:
    """One engine: load, generate greedily, report the tokens, linger so that the parent reads the final peaks."""
    from leanlm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(job["model"], progress=False, kv_cache_memory_bytes=KV_BYTES, **job["options"], **job["layout"])
    loaded = time.perf_counter() - start
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    print("RESULT " + json.dumps({"tokens": tokens, "load_s": loaded}), flush=True)
    time.sleep(2.0)
    llm.close()


def _hwm_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(model: str, layout: dict, options: dict) -> dict:
    """Run one layout in a fresh process tree; its tokens and every rank's peak RSS (rank 0 = the driver)."""
    job = json.dumps({"model": model, "layout": layout, "options": options})
    proc = subprocess.Popen([sys.executable, __file__, "--child", job], stdout=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            pids = [proc.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for pid in pids:
            if (hwm := _hwm_bytes(pid)) is not None:
                peaks[pid] = max(peaks.get(pid, 0), hwm)
        time.sleep(0.05)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{model} {layout} failed with exit status {proc.returncode}")
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    workers = [v for pid, v in peaks.items() if pid != proc.pid and v > 200 << 20]  # ranks, not helper processes
    return {**result, "driver": peaks.get(proc.pid, 0), "ranks": [peaks.get(proc.pid, 0), *sorted(workers)]}


def make_moe(directory: Path) -> str:
    """SmolLM2-135M upcycled to 8 experts, top-2 (Mixtral-shaped), saved as a float32 Mixtral safetensors dir."""
    from leanlm.compress import UpcycleConfig, compress
    from leanlm.formats import save_checkpoint
    from leanlm.formats.loader import load_checkpoint

    checkpoint = load_checkpoint("smollm2-135m-instruct", "float32", progress=False)
    compress(checkpoint.model, [UpcycleConfig(num_experts=8, top_k=2)], progress=False)
    import torch

    return str(save_checkpoint(checkpoint, directory / "smollm2-upcycled-8x", dtype=torch.float32))


def table(rows: list[tuple[str, str, dict, dict]]) -> str:
    lines = [
        "| model | layout | ranks' peak RSS (GB) | largest rank / one process | greedy tokens = one process "
        "| load (s) |",
        "|---|---|---|---|---|---|",
    ]
    for model, layout, result, base in rows:
        ranks = ", ".join(f"{r / 1e9:.2f}" for r in result["ranks"])
        ratio = max(result["ranks"]) / max(base["ranks"])
        same = "yes" if result["tokens"] == base["tokens"] else "NO"
        lines.append(f"| {model} | {layout} | {ranks} | {ratio:.2f}x | {same} | {result['load_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="write the markdown table here (and print it)")
    parser.add_argument("--results", type=Path, help="replace this file's section (docs/parallelism_results.md)")
    parser.add_argument("--only", choices=["qwen-f32", "qwen-codes", "moe"], action="append")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from leanlm.analysis.host import describe_machine

    qwen = "qwen2.5-coder-1.5b-instruct"
    runs = {
        "qwen-f32": (f"{qwen} (dequantized, float32)", qwen, dict(dtype="float32", dequantize_gguf=True), LAYOUTS),
        "qwen-codes": (f"{qwen} (Q4_K_M codes, float32)", qwen, dict(dtype="float32"), LAYOUTS),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.only or "moe" in args.only:
            moe = make_moe(Path(tmp))
            runs["moe"] = ("SmolLM2-135M upcycled 8x top-2 (float32)", moe, dict(dtype="float32"), MOE_LAYOUTS)
        for key, (label, model, options, layouts) in runs.items():
            if args.only and key not in args.only:
                continue
            base = None
            for name, layout in layouts.items():
                result = measure(model, layout, options)
                base = base or result
                rows.append((label, name, result, base))
                print(label, name, result, flush=True)
    text = f"{describe_machine()}\n\n{table(rows)}\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.results:
        old = args.results.read_text() if args.results.is_file() else ""
        head = old[: old.index(SECTION)] if SECTION in old else old + "\n"
        command = "python benchmarks/sliced_load.py " + " ".join(sys.argv[1:])
        intro = (
            f"Written by `{command}` on {time.strftime('%Y-%m-%d')}: peak resident memory (VmHWM, polled) of "
            f"every rank, each layout in a fresh process tree, {len(PROMPTS)} prompts x {MAX_TOKENS} greedy tokens "
            "each (every expert routed to, so one process's memory-mapped weights are all resident); what the "
            "numbers mean is in "
            "[parallelism.md](parallelism.md#peak-memory-per-rank-sliced-loading).\n\nMachine: "
        )
        args.results.write_text(f"{head}{SECTION}\n\n{intro}{text}")


if __name__ == "__main__":
    main()
