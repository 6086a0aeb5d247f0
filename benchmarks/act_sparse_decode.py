"""Activation sparsity (TEAL) on the default model, in one run: WikiText-2 perplexity and decode speed at batch 1
and at larger batches (the batch-size effect), next to the same model dense in bf16 (issue 17's target: 40%
activation sparsity at least 1.2x batch-1 decode at no more than +5% perplexity).

Every engine loads the bundled GGUF dequantized to bf16 (batched_decode's LeanLM engine); the sparse ones then
get `ActivationSparsityConfig(sparsity=s)` through `compress`, calibrated on gensim's Wikipedia articles (64 x 256
tokens, not the evaluation text): every decoder linear becomes ActSparseLinear, whose kernel skips the weight
rows of inputs at or below its threshold inside the native decode loop. Perplexity: 8 windows of 2048 tokens of
WikiText-2 test, the sparsity applied to every token. Speed: greedy decode of 16-token prompts, 128 new tokens,
repetitions alternating between engines; repetitions during which other processes took more than
--max-other-cpu of the CPU (/proc/stat) are discarded and counted.

    python benchmarks/act_sparse_decode.py --out docs/sparse-decode.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from batched_decode import leanlm_llm  # benchmarks/: the engine options every LeanLM row uses
from sparse_decode import (  # benchmarks/
    _dense_linear,
    decoder_linears,
    kernel_call,
    linear_bytes,
    loop_kinds,
    median_pass_times,
)

from leanlm.analysis.bench import LeanLMRunner, Repetitions, median
from leanlm.analysis.bench_suite import prompts_from_text
from leanlm.analysis.eval import make_windows, perplexity
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.compress import ActivationSparsityConfig, calibration_samples, compress, read_calibration_text
from leanlm.data import wikitext2_test_path
from leanlm.kernels import cpu_act_sparse
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.model.linear.act_sparse import ActSparseLinear

TARGET_SPEEDUP, TARGET_PPL, TARGET_SPARSITY = 1.2, 0.05, 0.4  # issue 17


def build_engines(model: str, sparsities: list[float], max_batch: int, trained: list[str]) -> tuple[dict, dict]:
    """name -> LLM (dense first, then one-shot TEAL at each sparsity, then the `trained` checkpoints: `leanlm train
    --recipe teal` outputs), and name -> what compress reported (the rows read at each batch)."""
    engines = {"dense bf16": leanlm_llm(model, max_batch, dequantize=True)}
    tokenizer = engines["dense bf16"].tokenizer
    ids = tokenizer.encode(read_calibration_text(), add_special_tokens=False)
    samples = calibration_samples(ids, 64, 256, seed=0)
    details = {}
    for s in sparsities:
        name = f"TEAL {s:.0%}"
        engines[name] = leanlm_llm(model, max_batch, dequantize=True)
        report = compress(engines[name].llm_engine.model, ActivationSparsityConfig(sparsity=s), samples, progress=False)
        details[name] = report.details["act-sparsity"]
    for path in trained:
        engines[f"{Path(path).name} (trained)"] = leanlm_llm(path, max_batch, dequantize=True)
    return engines, details


def rows_read(details: dict, name: str, batch: int) -> str:
    """The share of weight rows a batch reads, from compress's report on the calibration inputs: 100% for the
    dense model, "-" for a loaded checkpoint (no report)."""
    if name == "dense bf16":
        return "100%"
    share = details.get(name, {}).get(f"weight rows read at batch {batch}")
    return "-" if share is None else f"{share:.1%}"


def kernel_sweep(model: torch.nn.Module, levels: list[float], max_other: float, copies: int = 60) -> list[str]:
    """The kernel alone against the dense bf16 GEMV for each distinct decoder-linear shape of `model`, batch 1:
    `copies` random weights of each shape cycled (so they come from DRAM, as in decode), the threshold at the
    given quantile of |x|, median of 21 passes alternating, contaminated passes left out."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    shapes = sorted({(m.out_features, m.in_features) for m in decoder_linears(model)}, reverse=True)
    lines = ["| shape (N x K) | dense GEMV us | " + " | ".join(f"{s:.0%} of inputs zero" for s in levels) + " |"]
    lines.append("|---|---:|" + "---:|" * len(levels))
    for n, k in shapes:
        x, y = torch.randn(1, k, generator=gen).bfloat16(), torch.empty(1, n, dtype=torch.bfloat16)
        dense = [_dense_linear(torch.randn(n, k, generator=gen).bfloat16()) for _ in range(copies)]
        layers = {"dense": dense}
        for s in levels:  # inputs at or below the threshold are zero: the k-th smallest |x| zeroes k of them
            cut = round(s * k)
            threshold = float(x.float().abs().flatten().kthvalue(cut).values) if cut > 0 else 0.0
            layers[s] = [ActSparseLinear.from_linear(m, threshold) for m in dense]
        calls = {key: [kernel_call(m, x, y, threads) for m in ms] for key, ms in layers.items()}
        med = median_pass_times(calls, max_other)
        cells = [f"{med[s] / copies * 1e6:.1f}, {med['dense'] / med[s]:.2f}x" for s in levels]
        lines.append(f"| {n} x {k} | {med['dense'] / copies * 1e6:.1f} | " + " | ".join(cells) + " |")
    return lines


def timed(runners: dict, run, reps: int, max_other: float) -> dict[str, Repetitions]:
    """run(name, runner, rep) -> a value, `reps` times per runner alternating, contaminated ones discarded."""
    results = {name: Repetitions() for name in runners}
    for rep in range(reps):
        for name, runner in runners.items():
            with CpuMonitor() as monitor:
                value = run(name, runner, rep)
            results[name].add(value, monitor.sample, max_other)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--sparsities", default="0.25,0.4,0.5")
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--trained", nargs="*", default=[], help="checkpoints of `leanlm train --recipe teal` to add")
    ap.add_argument("--sweep-levels", default="0,0.25,0.4,0.5,0.7", help="kernel table levels ('' skips)")
    ap.add_argument("--out", default=None, help="markdown file whose act-sparse-decode(-MODEL) section gets the tables")
    args = ap.parse_args()
    if not cpu_act_sparse.is_available():
        raise SystemExit(f"the activation-sparse kernel is unavailable ({cpu_act_sparse.unavailable_reason()})")
    sparsities = [float(s) for s in args.sparsities.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    engines, details = build_engines(args.model, sparsities, max(batches), args.trained)
    runners = {name: LeanLMRunner(llm) for name, llm in engines.items()}
    tokenizer = engines["dense bf16"].tokenizer
    text = wikitext2_test_path().read_text()
    windows = make_windows(tokenizer.encode(text, add_special_tokens=False), 2048, max_windows=args.windows)
    ppl = {name: perplexity(llm, windows, use_tqdm=False).perplexity for name, llm in engines.items()}
    prompts = prompts_from_text(tokenizer, text, [16] * (args.reps * (1 + sum(batches)) + 1), seed=0)
    for runner in runners.values():
        runner.latency(prompts[0], 16)  # warm-up: kernels compiled, native loop built
    kinds = {name: loop_kinds(llm.llm_engine.model) for name, llm in engines.items()}
    assert all(k == {"act_sparse"} for n, k in kinds.items() if n != "dense bf16"), kinds

    def latency(name, runner, rep):
        return runner.latency(prompts[1 + rep], args.output_len)

    one = timed(runners, latency, args.reps, args.max_other_cpu)
    tpot = {name: median([s.tpot_s for s in reps.values]) for name, reps in one.items()}
    base = tpot["dense bf16"]
    lines = [
        f"Activation sparsity (TEAL, uniform per-linear thresholds on |x|) on {Path(args.model).name}, every decoder "
        f"linear; embedding and tied head dense. Perplexity: WikiText-2 test, {len(windows)} x 2048 windows, the "
        f"sparsity applied to every token. Batch 1: {args.output_len} new tokens after 16-token prompts, "
        f"{args.reps} repetitions alternating (median time per output token). Machine: {describe_machine()}. "
        f"Command: `python benchmarks/act_sparse_decode.py {' '.join(sys.argv[1:])}`.",
        "",
        "| model | perplexity | vs dense | weight rows read (batch 1) | TPOT ms | tokens/s | vs dense bf16 | kept / "
        "discarded reps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, reps in one.items():
        lines.append(
            f"| {name} | {ppl[name]:.2f} | {ppl[name] / ppl['dense bf16'] - 1:+.1%} | {rows_read(details, name, 1)} | "
            f"{tpot[name] * 1000:.2f} | {1 / tpot[name]:.1f} | {base / tpot[name]:.2f}x | "
            f"{len(reps.values)} / {len(reps.discarded)} |"
        )
    target = f"TEAL {TARGET_SPARSITY:.0%}"
    if target in tpot:
        speed, loss = base / tpot[target], ppl[target] / ppl["dense bf16"] - 1
        verdict = "met" if speed >= TARGET_SPEEDUP and loss <= TARGET_PPL else "not met"
        lines += [
            "",
            f"Target (issue 17): {TARGET_SPARSITY:.0%} activation sparsity >= {TARGET_SPEEDUP}x batch-1 decode at "
            f"<= +{TARGET_PPL:.0%} perplexity: {speed:.2f}x at {loss:+.1%}, {verdict}.",
        ]
    lines += batch_table(engines, details, prompts[1 + args.reps :], batches, args)
    if args.sweep_levels:
        levels = [float(s) for s in args.sweep_levels.split(",")]
        lines += [
            "",
            "The kernel alone against the dense bf16 GEMV per decoder-linear shape, batch 1 (60 random weights of "
            "each shape cycled, so they come from DRAM; us per product, speedup over dense):",
            "",
            *kernel_sweep(engines["dense bf16"].llm_engine.model, levels, args.max_other_cpu),
        ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        section = "act-sparse-decode" if args.model == DEFAULT_MODEL else f"act-sparse-decode-{Path(args.model).name}"
        replace_section(Path(args.out), section, report)


def batch_table(engines: dict, details: dict, prompts: list, batches: list[int], args) -> list[str]:
    """The batch-size effect: a weight row can be skipped only when every request's input is below the threshold
    there, so the share read (from the calibration inputs, B rows at a time) and the speedup shrink with B."""
    runners = {name: LeanLMRunner(llm) for name, llm in engines.items()}
    header = "| model | " + " | ".join(f"batch {b}: rows read, tok/s, vs dense" for b in batches) + " |"
    lines = [
        "",
        f"Batch-size effect: {args.reps} repetitions of B requests decoded together ({args.output_len} new tokens "
        "each, output tokens per second of the whole generate call).",
        "",
        header,
        "|---|" + "---:|" * len(batches),
    ]
    rates = {name: {} for name in runners}
    offset = 0
    for b in batches:

        def throughput(name, runner, rep, b=b, offset=offset):
            return runner.throughput(prompts[offset + rep * b : offset + (rep + 1) * b], args.output_len)

        for name, reps in timed(runners, throughput, args.reps, args.max_other_cpu).items():
            rates[name][b] = median(reps.values)
        offset += args.reps * b
    for name in runners:
        cells = []
        for b in batches:
            rate = rates[name][b]
            cells.append(f"{rows_read(details, name, b)}, {rate:.0f}, {rate / rates['dense bf16'][b]:.2f}x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Decoder linear weights: {linear_bytes(engines['dense bf16'].llm_engine.model) / 1e6:.1f} MB."]
    return lines


if __name__ == "__main__":
    main()
