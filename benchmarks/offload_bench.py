"""Weight offloading side by side: LeanLM with every weight in memory, LeanLM with --max-weight-memory at a fraction
(default half) of its weight bytes, and HF transformers + accelerate offloading at the same limit
(`device_map="auto", max_memory={"cpu": LIMIT}, offload_folder=...`: what does not fit goes to disk), all on one
dense bf16 safetensors directory (write one with save_checkpoint of the dequantized model, see --dense-dir).

Each engine runs in a child process of its own, so its resident set is its own: VmHWM is reset after loading
(/proc/self/clear_refs) and read after generation, so "peak RSS" is the peak while generating; the load's peak is
reported beside it. Every timed repetition records the CPU share other processes used (/proc/stat); contaminated
repetitions are discarded. Greedy, the same prompt token ids for every engine, EOS ignored.

    python benchmarks/offload_bench.py --dense-dir /tmp/qwen15b-bf16 --max-tokens 8 --out docs/offload.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = 'def quicksort(items):\n    """Sort a list of numbers in ascending order and return it."""\n'


def proc_status_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0: '5' to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _leanlm(job: dict):
    from leanlm import LLM, SamplingParams
    from leanlm.model.offload import module_tensors, weight_bytes

    options = {} if job["limit"] is None else {"max_weight_memory": job["limit"]}
    llm = LLM(job["dense_dir"], dtype="bfloat16", progress=False, kv_cache_memory_bytes=64 << 20, **options)
    model = llm.llm_engine.model_runner.model
    total = weight_bytes(module_tensors(model))
    ids = job["prompt_ids"] or llm.get_tokenizer().encode(PROMPT)

    def generate(n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return list(llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids)

    info = {"weight_bytes": total, "prompt_ids": ids}
    if llm.offloaded is not None:
        info["plan"] = llm.offloaded.describe()
    return generate, info, lambda: {} if llm.offloaded is None else _streamer_stats(llm.offloaded)


def _streamer_stats(streamer) -> dict:
    plan = streamer.plan
    return {
        "peak_live_bytes": streamer.peak_live_bytes,
        "peak_weight_bytes": plan.resident_bytes + streamer.peak_live_bytes,
        "reads": streamer.num_reads,
        "prefetch_hits": streamer.num_prefetch_hits,
    }


def _hf(job: dict):
    import torch
    from transformers import AutoModelForCausalLM

    offload_dir = tempfile.mkdtemp(prefix="hf-offload-", dir=job["work_dir"])
    options = {}
    if job["limit"] is not None:
        options = {"device_map": "auto", "max_memory": {"cpu": job["limit"]}, "offload_folder": offload_dir}
    model = AutoModelForCausalLM.from_pretrained(job["dense_dir"], dtype=torch.bfloat16, **options).eval()
    ids = torch.tensor([job["prompt_ids"]])
    placement = {}
    for where in getattr(model, "hf_device_map", {}).values():
        placement[str(where)] = placement.get(str(where), 0) + 1

    def generate(n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    return generate, {"placement": placement}, dict


def worker(job: dict) -> dict:
    import torch

    from leanlm.analysis.host import CpuMonitor

    torch.set_num_threads(job["threads"])
    t0 = time.perf_counter()
    generate, info, stats = (_hf if job["engine"].startswith("hf") else _leanlm)(job)
    info["load_s"] = time.perf_counter() - t0
    info["load_peak_rss"], info["loaded_rss"] = proc_status_bytes("VmHWM"), proc_status_bytes("VmRSS")
    reset_peak_rss()
    generate(1)  # warm-up: the prefill path once (and, offloaded, every streamed layer read once)
    reps = []
    for _ in range(job["reps"]):
        with CpuMonitor() as mon:
            t0 = time.perf_counter()
            tokens = generate(job["max_tokens"])
            seconds = time.perf_counter() - t0
        reps.append({"seconds": seconds, "other_cpu": mon.sample.other_share, "tokens": tokens})
    info |= {"reps": reps, "peak_rss": proc_status_bytes("VmHWM"), "rss": proc_status_bytes("VmRSS")} | stats()
    return info


def run_child(job: dict, timeout_s: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]))
    cmd = [sys.executable, __file__, "--worker", json.dumps(job)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{job['engine']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict], args, limit: int, machine: str) -> str:
    base = results["leanlm in memory"]
    base_tokens = base["reps"][0]["tokens"]
    lines = [
        f"Machine: {machine}. Model: `{args.dense_dir.name}` (dense bf16, written by save_checkpoint). "
        f"Weight bytes (LeanLM's resident tensors, in memory): {base['weight_bytes']:,}; limit "
        f"{limit:,} bytes ({args.fraction:g} of them). {len(base['prompt_ids'])}-token prompt, {args.max_tokens} "
        f"greedy tokens (EOS ignored), {args.threads} threads, {args.reps} timed repetitions per engine after one "
        f"warm-up; repetitions in which other processes used more than {args.max_other_cpu:.0%} of the CPUs are "
        "discarded. Peak RSS: VmHWM of the engine's own process, reset after loading (the load's peak beside it).",
        "",
        "| engine | tokens/s (best kept) | s per run (kept) | discarded | tokens/s, every rep (others' CPU) | "
        "peak RSS generating (GB) | RSS after load (GB) | load peak RSS (GB) | load (s) | output = LeanLM in memory |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        kept = [rep for rep in r["reps"] if rep["other_cpu"] <= args.max_other_cpu]
        best = f"{args.max_tokens / min(rep['seconds'] for rep in kept):.2f}" if kept else "n/a"
        runs = ", ".join(f"{rep['seconds']:.1f}" for rep in kept) or "-"
        same = all(rep["tokens"] == base_tokens for rep in r["reps"])
        every = ", ".join(f"{args.max_tokens / rep['seconds']:.2f} ({rep['other_cpu']:.0%})" for rep in r["reps"])
        lines.append(
            f"| {name} | {best} | {runs} | {len(r['reps']) - len(kept)} | {every} | {r['peak_rss'] / 1e9:.2f} | "
            f"{r['loaded_rss'] / 1e9:.2f} | {r['load_peak_rss'] / 1e9:.2f} | {r['load_s']:.1f} | "
            f"{'yes' if same else 'NO'} |"
        )
    lines.append("")
    for name, r in results.items():
        extra = {k: r[k] for k in ("plan", "placement", "peak_weight_bytes", "reads", "prefetch_hits") if k in r}
        lines.append(f"- {name}: {json.dumps(extra)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dense-dir", type=Path, required=True, help="dense bf16 safetensors directory")
    ap.add_argument("--fraction", type=float, default=0.5, help="the limit, as a fraction of the weight bytes")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--engines", default="leanlm in memory,leanlm offloaded,hf+accelerate offloaded")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    from leanlm.analysis.host import describe_machine

    names = [n.strip() for n in args.engines.split(",")]
    if names[0] != "leanlm in memory":
        raise SystemExit("the first engine must be 'leanlm in memory': it fixes the prompt, limit and reference")
    job = {"dense_dir": str(args.dense_dir), "max_tokens": args.max_tokens, "reps": args.reps}
    job |= {"threads": args.threads, "limit": None, "prompt_ids": None}
    with tempfile.TemporaryDirectory(prefix="offload-bench-", dir=args.dense_dir.parent) as work_dir:
        job["work_dir"] = work_dir
        results = {names[0]: run_child(job | {"engine": names[0]}, args.timeout_s)}
        limit = int(results[names[0]]["weight_bytes"] * args.fraction)
        job |= {"prompt_ids": results[names[0]]["prompt_ids"]}
        for name in names[1:]:
            offloaded = "offloaded" in name
            results[name] = run_child(job | {"engine": name, "limit": limit if offloaded else None}, args.timeout_s)
            print(name, json.dumps({k: v for k, v in results[name].items() if k != "prompt_ids"}), flush=True)
    machine = describe_machine().replace(f"{os.cpu_count()} CPUs", f"{os.cpu_count()} CPUs (shared)")
    text = table(results, args, limit, machine)
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    else:
        main()
