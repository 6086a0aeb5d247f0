"""Batched decode on the CPU: the linear kernels against the measured vdpbf16ps peak, and offline throughput
of the short-prompt workload at several batch sizes, LeanLM next to HF transformers, in one run.

Workload (issue 16): 64 prompts of 16-32 tokens (fixed seed), 128 greedy output tokens each, the engine
capped at `batch` running requests (HF: padded batches of `batch`, sorted by length). Engines:
- LeanLM on the bundled GGUF as shipped (Q4_1 linears on their 4-bit codes, the tied Q8_0 embedding as an int8 head);
- LeanLM on the same file dequantized to bf16 (`--dequantize-gguf`);
- HF transformers on a dense bf16 safetensors directory written from the dequantized model;
- llama.cpp's llama-batched-bench on the same GGUF (when benchmarks/build_llama_server.sh has built it):
  `batch` sequences of a 24-token prompt (the workload's mean) and 128 generated tokens each, 2 threads;
  its output tok/s is batch * 128 / (prompt time + generation time), as ours counts.
Every timed repetition records the CPU share other processes used (/proc/stat); repetitions above
--max-other-cpu are discarded and counted.

    python benchmarks/batched_decode.py --out docs/batched-decode.md
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from leanlm import LLM, SamplingParams
from leanlm.analysis.bench import HFRunner
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.peers import PEERS_DIR
from leanlm.kernels import cpu_gemm
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model

LLAMA_BATCHED_BENCH = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-batched-bench"

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576)}
SHAPES |= {"down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}


def gflops(fn, m: int, n: int, k: int, min_seconds: float = 0.15) -> float:
    """Best of 3 timed runs, each repeating fn until min_seconds passed."""
    fn()
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_seconds:
            fn()
            reps += 1
        best = max(best, 2 * m * n * k * reps / elapsed / 1e9)
    return best


def linear_table(rows: list[int]) -> list[str]:
    peak = cpu_gemm.measure_dot_peak()
    lines = [
        f"Measured vdpbf16ps peak on {torch.get_num_threads()} threads: **{peak:.0f} GFLOP/s** "
        "(register-only dot-product chains). GFLOP/s of one linear, weights hot in cache, "
        "torch `F.linear` (oneDNN) / LeanLM packed kernel (% of peak):",
        "",
        "| rows | " + " | ".join(SHAPES) + " |",
        "|---:|" + "---:|" * len(SHAPES),
    ]
    for m in rows:
        cells = []
        for n, k in SHAPES.values():
            x = torch.randn(m, k).to(torch.bfloat16)
            w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
            packed = cpu_gemm.pack(w)
            ours = gflops(lambda: cpu_gemm.gemm(x, packed), m, n, k)
            theirs = gflops(lambda: F.linear(x, w), m, n, k)
            cells.append(f"{theirs:.0f} / **{ours:.0f}** ({100 * ours / peak:.0f}%)")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def short_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 32))] for _ in range(n)]


def timed(run, reps: int, max_other: float) -> tuple[float, int, float]:
    """(best tokens/s over clean repetitions, discarded count, worst other-CPU share kept)."""
    best, discarded, worst = 0.0, 0, 0.0
    for _ in range(reps):
        with CpuMonitor() as mon:
            t0 = time.perf_counter()
            tokens = run()
            rate = getattr(run, "rate", None) or tokens / (time.perf_counter() - t0)
        if mon.sample.is_contaminated(max_other):
            discarded += 1
            continue
        best, worst = max(best, rate), max(worst, mon.sample.other_share)
    return best, discarded, worst


def leanlm_runner(model: str, batch: int, dequantize: bool, prompts, output_len: int):
    llm = LLM(model, dtype="bfloat16", progress=False, max_num_seqs=batch, dequantize_gguf=dequantize)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm + pack

    def run() -> int:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def hf_runner(hf_dir: Path, batch: int, prompts, output_len: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    runner = HFRunner(model, pad_id=0, batch_size=batch)

    def run() -> int:
        runner.throughput(prompts, output_len)
        return len(prompts) * output_len

    return run


def llama_cpp_runner(model: str, batch: int, output_len: int, prompt_len: int = 24):
    """llama-batched-bench, one configuration per call; None when it is not built."""
    if not LLAMA_BATCHED_BENCH.is_file():
        return None
    command = [str(LLAMA_BATCHED_BENCH), "-m", str(resolve_model(model)), "-t", str(torch.get_num_threads())]
    command += ["-c", str(batch * (prompt_len + output_len) + 64), "-b", "2048", "-ub", "512"]
    command += ["-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(batch), "--output-format", "jsonl"]

    def run() -> int:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        run.rate = batch * output_len / (row["t_pp"] + row["t_tg"])  # timed by the tool, not by us
        return batch * output_len

    return run


def write_dense_dir(model: str, out: Path) -> None:
    from leanlm.compress.checkpoint import save_checkpoint
    from leanlm.llm import load_model

    save_checkpoint(load_model(model, dtype="bfloat16", progress=False), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-batches", default="32", help="batch sizes to run HF at (it is slow)")
    ap.add_argument("--linear-rows", default="8,16,32,64,128,256,512")
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    lines = [f"Machine: {describe_machine()}.", ""]
    lines += linear_table([int(r) for r in args.linear_rows.split(",")]) + [""]
    print("\n".join(lines), flush=True)

    prompts = short_prompts(args.num_prompts, seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = {int(b) for b in args.hf_batches.split(",") if b}
    table = [
        f"Offline throughput, output tokens/s (best of {args.reps} clean repetitions; {args.num_prompts} prompts of "
        f"16-32 tokens x {args.output_len} greedy tokens; batch 1 runs 4 prompts):",
        "",
        "| batch | LeanLM, GGUF Q4_1 codes | LeanLM, bf16 (dequantized) | HF dense bf16 | llama.cpp, GGUF Q4_1 "
        "| codes / HF | bf16 / HF | codes / llama.cpp |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        if hf_batches:
            write_dense_dir(args.model, Path(tmp) / "dense")
        for batch in batches:
            work = prompts[:4] if batch == 1 else prompts
            rates = {}
            for name, make in (
                ("codes", lambda: leanlm_runner(args.model, batch, False, work, args.output_len)),
                ("bf16", lambda: leanlm_runner(args.model, batch, True, work, args.output_len)),
                ("hf", lambda: hf_runner(Path(tmp) / "dense", batch, work, args.output_len)),
                ("llama.cpp", lambda: llama_cpp_runner(args.model, batch, args.output_len)),
            ):
                if name == "hf" and batch not in hf_batches:
                    continue
                run = make()
                if run is None:
                    continue
                rate, dropped, worst = timed(run, args.reps, args.max_other_cpu)
                rates[name] = rate
                notes.append(f"batch {batch} {name}: {dropped} repetition(s) discarded, other CPU <= {worst:.1%}")
                print(f"batch {batch} {name}: {rate:.1f} tok/s ({notes[-1]})", flush=True)
                del run
            hf, llama = rates.get("hf"), rates.get("llama.cpp")
            ratio = [f"{rates[k] / hf:.2f}x" if hf else "-" for k in ("codes", "bf16")]
            ratio.append(f"{rates['codes'] / llama:.2f}x" if llama else "-")
            cells = [f"{rates[k]:.1f}" if k in rates else "-" for k in ("codes", "bf16", "hf", "llama.cpp")]
            table.append(f"| {batch} | " + " | ".join(cells + ratio) + " |")
    lines += table + ["", "Repetitions: " + "; ".join(notes) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(f"# Batched decode (`python benchmarks/batched_decode.py`)\n\n{text}")


if __name__ == "__main__":
    main()
