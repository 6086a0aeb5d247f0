"""CALM's per-token early exit at decode on SmolLM2 with trained exits, in one run on this machine.

    python benchmarks/early_exit.py --model smol-exits --doc docs/training.md

1. Thresholds. Each exit's confidence (softmax, top-2 gap, saturation) and its agreement with the whole model,
   teacher-forced on held-out windows of the training text (gensim's Wikipedia, never WikiText-2); per exit, the
   smallest threshold whose confident tokens agree with the whole model's greedy token at a stated consistency
   (leanlm.train.exits.calibrate_threshold), and the share of tokens that reach it.
2. Batch-1 greedy decode of the four real prompts of benchmarks/speculative.py (code edit, code completion,
   extractive, open chat), up to 128 tokens: the plain engine, an engine whose exit check never passes (what a
   check costs), and CALM at each calibrated setting. Repetitions alternate the engines; each records the CPU
   share other processes took (/proc/stat), and contaminated ones are discarded. Reported: decode time per token
   (the plain engine's prefill left out), its speedup, the share of tokens that left early, the layers run per
   token, and how far CALM's output stays identical to the plain engine's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from speculative import generate, load_net, prefault, prompts

from leanlm.analysis.bench import median
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.compress.calibration import read_calibration_text
from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.sampling_params import SamplingParams
from leanlm.train.data import TokenWindows
from leanlm.train.exits import CONFIDENCE_MEASURES, calibrate_threshold, exit_layers, exit_statistics


@dataclass
class Setting:
    name: str
    early_exit: str | None  # EngineConfig.early_exit
    measure: str
    calibrated: str  # what the thresholds promise: per exit, its held-out exit share and agreement


@dataclass
class Row:
    setting: Setting
    ms_per_token: float  # per prompt, the median decode time per output token; the mean over prompts
    speedup: float  # plain / this
    exit_rate: float
    mean_layers: float
    identical_prefix: float  # share of the plain engine's tokens reproduced before the first difference
    agreement: float  # position-by-position share equal to the plain engine's tokens
    kept: int
    discarded: int


MIN_SHARE = 0.01  # an exit whose held-out share is below this is left out: its check would cost more than it saves


def calibrate(net, tokenizer, windows: int, seq_len: int, consistencies) -> list[Setting]:
    """A setting per (measure, consistency) with at least one exit reaching it for MIN_SHARE of the tokens."""
    ids = tokenizer.encode(read_calibration_text(None), add_special_tokens=False)
    held_out = TokenWindows.from_ids(ids, seq_len, windows).held_out
    stats = exit_statistics(net, held_out, batch_size=4, dtype="bfloat16")
    for k, s in stats.items():
        print(f"exit {k}: KL {s.mean_kl:.2f}, top-1 agreement {s.agreement:.3f}", flush=True)
    settings = [Setting("exit check never passes", f"{exit_layers(net)[-1]}:1.01", "softmax", "-")]
    for measure in CONFIDENCE_MEASURES:
        for consistency in consistencies:
            chosen = [calibrate_threshold(s, measure, consistency) for s in stats.values()]
            chosen = [c for c in chosen if c.threshold is not None and c.exit_fraction >= MIN_SHARE]
            if not chosen:
                print(f"{measure} at {consistency:.0%}: no exit reaches it", flush=True)
                continue
            spec = ",".join(f"{c.layer}:{c.threshold:.6g}" for c in chosen)
            promise = ", ".join(f"{c.layer}: {c.exit_fraction:.1%} at {c.agreement:.3f}" for c in chosen)
            settings.append(Setting(f"{measure}, {consistency:.0%} consistency", spec, measure, promise))
    return settings


def decode_rows(net, tokenizer, settings: list[Setting], reps: int, threshold: float) -> list[Row]:
    engines = {
        s.name: LLMEngine(
            net,
            tokenizer,
            EngineConfig.from_options(
                enable_prefix_caching=False,
                kv_cache_memory_bytes=512 << 20,
                early_exit=s.early_exit,
                early_exit_measure=s.measure,
            ),
            torch.device("cpu"),
            torch.bfloat16,
        )
        for s in settings
    }
    prompt_ids = prompts(tokenizer)
    params = SamplingParams(max_tokens=128, temperature=0.0)
    for engine in engines.values():  # warm-up: kernels, and memory touched once
        generate(engine, max(prompt_ids.values(), key=len), SamplingParams(max_tokens=16))
    before = {name: engine.stats().early_exit for name, engine in engines.items()}
    per_token = {(n, p): [] for n in engines for p in prompt_ids}
    discarded = dict.fromkeys(engines, 0)
    tokens = {}
    for rep in range(reps):
        for name, engine in engines.items():
            for prompt, ids in prompt_ids.items():
                with CpuMonitor() as monitor:
                    t0 = time.perf_counter()
                    tokens[name, prompt], ttft = generate(engine, ids, params)
                    seconds = time.perf_counter() - t0
                if monitor.sample.is_contaminated(threshold):
                    discarded[name] += 1
                else:
                    per_token[name, prompt].append((seconds - ttft) / max(len(tokens[name, prompt]) - 1, 1))
        print(f"repetition {rep + 1} of {reps} done", flush=True)
    plain = sum(median(per_token[settings[0].name, p]) for p in prompt_ids) / len(prompt_ids)
    rows = []
    for s in settings:
        stats, first = engines[s.name].stats().early_exit, before[s.name]
        ms = sum(median(per_token[s.name, p]) for p in prompt_ids) / len(prompt_ids)
        same = prefix = total = 0
        for p in prompt_ids:
            ref, got = tokens[settings[0].name, p], tokens[s.name, p]
            same += sum(a == b for a, b in zip(ref, got))
            prefix += next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            total += len(ref)
        if stats is None:
            exit_rate, layers = 0.0, float(net.config.num_hidden_layers)
        else:
            tokens_run = stats.num_tokens - first.num_tokens
            exited = sum(stats.exited.values()) - sum(first.exited.values())
            exit_rate = exited / tokens_run if tokens_run else 0.0
            layers = (stats.layers_run - first.layers_run) / tokens_run if tokens_run else 0.0
        kept = reps * len(prompt_ids) - discarded[s.name]
        rows.append(
            Row(s, 1e3 * ms, plain / ms, exit_rate, layers, prefix / total, same / total, kept, discarded[s.name])
        )
        print(rows[-1], flush=True)
    return rows


def format_report(rows: list[Row], args) -> str:
    lines = [
        f"Batch-1 greedy decode of {args.model} with CALM's early exit: the four prompts of "
        "benchmarks/speculative.py, up to 128 tokens each, "
        f"{args.reps} alternating repetitions per engine (discarded: other processes above "
        f"{args.threshold:.0%} of the CPU). Thresholds calibrated on {args.windows} held-out windows of "
        f"{args.seq_len} tokens of the training text (gensim's Wikipedia). {describe_machine()}. Command: "
        f"`python benchmarks/early_exit.py --model {args.model} --reps {args.reps}`.",
        "",
        "| setting | thresholds (exit: held-out share exiting at agreement) | ms / token | vs plain | tokens exiting "
        "| layers / token | identical prefix | same token, by position | kept / discarded |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.setting.name} | {r.setting.early_exit or '-'}: {r.setting.calibrated} | {r.ms_per_token:.2f} "
            f"| {r.speedup:.2f}x | {r.exit_rate:.1%} | {r.mean_layers:.1f} | {r.identical_prefix:.1%} "
            f"| {r.agreement:.1%} | {r.kept} / {r.discarded} |"
        )
    lines.append("")
    lines.append("ms / token: the mean over the four prompts of each prompt's median decode time per token.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint with exits (`leanlm train --exits ... --out DIR`)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.10, help="discard repetitions above this other-CPU share")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows for the thresholds")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--consistency", default="0.95,0.8", help="consistencies to calibrate for")
    ap.add_argument("--prefault-gib", type=int, default=2)
    ap.add_argument("--doc", default=None, help="replace the early-exit-decode section of this markdown file")
    args = ap.parse_args()
    prefault(args.prefault_gib)
    net, tokenizer = load_net(args.model)
    if not exit_layers(net):
        raise SystemExit(f"{args.model} has no trained exits: make one with leanlm train --exits 8,16,24")
    consistencies = [float(c) for c in args.consistency.split(",")]
    settings = [Setting("plain", None, "softmax", "-")]
    settings += calibrate(net, tokenizer, args.windows, args.seq_len, consistencies)
    report = format_report(decode_rows(net, tokenizer, settings, args.reps, args.threshold), args)
    print(report)
    if args.doc:
        replace_section(Path(args.doc), "early-exit-decode", report)


if __name__ == "__main__":
    main()
