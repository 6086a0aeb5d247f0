"""MoEfication (Zhang et al. 2022) of the bundled model, in one run: WikiText-2 perplexity at top-k fractions of E
experts for each neuron split (with the router, and with oracle routing: the experts the dense FFN actually uses
most), the dense FFN's activation sparsity, and batch-1 decode of the 25% model against the dense one.

Every engine loads the model dequantized to bf16; the MoE ones are made by `compress(model, MoefyConfig(...))` on
gensim's Wikipedia articles (--calib-samples x --calib-len tokens, never the evaluation text), once per split, and
`set_top_k` moves one split through every fraction. Perplexity: --windows x --seq-len tokens of WikiText-2 test.
Decode: greedy, 16-token prompts, --output-len new tokens, repetitions alternating between engines; a repetition
during which other processes took more than --max-other-cpu of the CPU (/proc/stat) is discarded and counted.

    python benchmarks/moefy_bench.py --out docs/moefication.md
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from batched_decode import leanlm_llm  # benchmarks/: the engine options every LeanLM row uses

from leanlm.analysis.bench import LeanLMRunner, Repetitions, median
from leanlm.analysis.bench_suite import prompts_from_text
from leanlm.analysis.eval import make_windows, perplexity
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.compress import MoefyConfig, calibration_samples, compress, read_calibration_text
from leanlm.compress.transform.moefy import oracle_routing, set_top_k
from leanlm.data import wikitext2_test_path
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.model.mlp import LlamaMLP
from leanlm.model.moe import SparseMoeBlock

TARGET_SPEEDUP = 1.3  # issue 37: batch-1 decode at 25% of the FFN per token


def moefied(args, split: str, router: str, samples: torch.Tensor, experts: int | None = None, shared: int = 0):
    """A bf16 engine whose model is MoEfied (set_top_k then picks the fraction), the method's
    summary (router agreement with the oracle and the dense activations' sparsity, on the calibration tokens)."""
    llm = leanlm_llm(args.model, 4, dequantize=True)
    # top-25% while compressing: the summary's router / oracle agreement is measured at that k
    experts = experts or args.experts
    top_k = max(1, round(0.25 * experts)) if not shared else args.shared_top_k
    config = MoefyConfig(num_experts=experts, top_k=top_k, split=split, router=router, shared_neurons=shared)
    start = time.perf_counter()
    report = compress(llm.llm_engine.model, config, samples, progress=False)
    return llm, report.details.get("moefy", {}), time.perf_counter() - start


def sweep(llm, fractions: list[float], experts: int, windows, oracle: bool) -> dict[float, tuple[float, float | None]]:
    """fraction -> (perplexity with the router, with oracle routing or None)."""
    out = {}
    model = llm.llm_engine.model
    for frac in fractions:
        set_top_k(model, max(1, round(frac * experts)))
        routed = perplexity(llm, windows, use_tqdm=False).perplexity
        best = None
        if oracle and frac < 1:
            with oracle_routing(model):
                best = perplexity(llm, windows, use_tqdm=False).perplexity
        out[frac] = (routed, best)
        print(f"  {frac:.0%}: {routed:.3f} / {best}", flush=True)
    return out


def timed(runners: dict, prompts: list, output_len: int, reps: int, max_other: float) -> dict[str, Repetitions]:
    """Batch-1 greedy decode, runners alternating, until each has `reps` clean repetitions or 4 x reps rounds ran;
    contaminated repetitions are discarded (and counted)."""
    results = {name: Repetitions() for name in runners}
    for attempt in range(4 * reps):
        if all(len(r.values) >= reps for r in results.values()):
            break
        for name, runner in runners.items():
            with CpuMonitor() as monitor:
                sample = runner.latency(prompts[attempt], output_len)
            results[name].add(sample.tpot_s, monitor.sample, max_other)
    return results


def layer_profile(llm, prompt: list[int], output_len: int) -> dict[str, float]:
    """Milliseconds per decoded token in each kind of module on the per-layer path (forward hooks, decode steps of
    one row only): attention, the MLP block and, in an MoE block, its router and its experts (the rest of the
    block is routing and dispatch: top-k, sort, gather, index_add)."""
    model = llm.llm_engine.model
    spent, handles, starts = defaultdict(float), [], {}

    def watch(module, kind):
        def pre(mod, args):
            if args[0].shape[0] == 1:
                starts[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            if args[0].shape[0] == 1 and id(mod) in starts:
                spent[kind] += time.perf_counter() - starts.pop(id(mod))

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    for layer in model.model.layers:
        watch(layer.self_attn, "attention")
        watch(layer.input_layernorm, "norms")
        watch(layer.post_attention_layernorm, "norms")
        watch(layer.mlp, "MLP block")
        if isinstance(layer.mlp, SparseMoeBlock):
            watch(layer.mlp.gate, "  router")
            for expert in layer.mlp.experts:
                watch(expert, "  experts")
    try:
        sample = LeanLMRunner(llm).latency(prompt, output_len)
    finally:
        for h in handles:
            h.remove()
    steps = len(sample.token_times_s) + 1
    profile = {kind: 1000 * s / steps for kind, s in spent.items()}
    profile["step (all)"] = 1000 * sample.tpot_s
    return profile


def cut_ffn(llm, fraction: float) -> None:
    """Keep the first `fraction` of every layer's FFN neurons, as a dense MLP (a fixed expert subset, no router): its
    native decode loop reads what a top-k step would, so its speed is what a native MoE decode path could reach."""
    model = llm.llm_engine.model
    width = round(fraction * model.config.intermediate_size)
    for layer in model.model.layers:
        mlp = layer.mlp
        with torch.device("meta"):
            cut = LlamaMLP(model.config.hidden_size, width)
        weights = {"gate_proj.weight": mlp.gate_proj.weight[:width], "up_proj.weight": mlp.up_proj.weight[:width]}
        weights["down_proj.weight"] = mlp.down_proj.weight[:, :width]
        cut.load_state_dict({k: v.contiguous().clone() for k, v in weights.items()}, assign=True)
        layer.mlp = cut.requires_grad_(False)
    model.config = dataclasses.replace(model.config, intermediate_size=width)


def ffn_share(model) -> float:
    """The FFN's share of the bf16 weight bytes a decode step reads (embedding rows aside: one row per token)."""
    layer = model.model.layers[0]
    ffn = 3 * model.config.hidden_size * model.config.intermediate_size
    attn = sum(p.numel() for p in layer.self_attn.parameters())
    head = model.lm_head.weight.numel()
    return ffn / (ffn + attn + head / len(model.model.layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--splits", default="coactivation,weight")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument(
        "--fine-experts", type=int, default=96, help="also the first split at this E (the paper's small experts); 0: no"
    )
    # one torch thread needs one of the 2 cores: a repetition counts while the others left it free (<= half the CPU)
    ap.add_argument("--max-other-cpu", type=float, default=0.5)
    ap.add_argument("--parts", default="quality,decode", help="quality (perplexity), decode (speed), shared")
    ap.add_argument("--shared-neurons", type=int, default=192, help="shared part: neurons in the shared expert")
    ap.add_argument("--shared-experts", type=int, default=14, help="shared part: routed experts")
    ap.add_argument("--shared-top-k", type=int, default=2, help="shared part: routed experts run per token")
    ap.add_argument("--out", default=None, help="markdown file whose moefy-PART(-MODEL) sections get the tables")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dense = leanlm_llm(args.model, 4, dequantize=True)
    tok = dense.tokenizer
    samples = calibration_samples(tok.encode(read_calibration_text(), add_special_tokens=False),
                                  args.calib_samples, args.calib_len, seed=0)  # fmt: skip
    text = wikitext2_test_path().read_text()
    suffix = "" if args.model == DEFAULT_MODEL else f"-{Path(args.model).name}"
    parts = {"quality": quality, "decode": decode, "shared": shared_expert}
    for part in args.parts.split(","):
        report = parts[part](args, dense, samples, text)
        print(report, flush=True)
        if args.out:
            replace_section(Path(args.out), f"moefy-{part}{suffix}", report)


def quality(args, dense, samples, text) -> str:
    """Perplexity of every split and router at every fraction (and the oracle's), and the split statistics."""
    fractions = [float(f) for f in args.fractions.split(",")]
    splits = args.splits.split(",")
    windows = make_windows(dense.tokenizer.encode(text, add_special_tokens=False), args.seq_len,
                           max_windows=args.windows)  # fmt: skip
    base = perplexity(dense, windows, use_tqdm=False).perplexity
    print(f"dense {base:.3f}", flush=True)
    results, stats, seconds = {}, {}, {}
    runs = [(split, split, "ridge", args.experts, fractions, True) for split in splits]
    if args.fine_experts:
        small = [f for f in fractions if f <= 0.5]
        runs.append((f"{splits[0]}, E = {args.fine_experts}", splits[0], "ridge", args.fine_experts, small, True))
    runs.append(("weight, centroid router", "weight", "centroid", args.experts, fractions[:1], False))
    for name, split, router, experts, fracs, oracle in runs:
        llm, stats[name], seconds[name] = moefied(args, split, router, samples, experts)
        print(name, stats[name], flush=True)
        results[name] = sweep(llm, fracs, experts, windows, oracle)
        del llm
        gc.collect()
    stats.pop("weight, centroid router", None)  # no data: no statistics
    return render_quality(args, base, results, stats, seconds)


def shared_expert(args, dense, samples, text) -> str:
    """A shared always-on expert of the busiest neurons plus top-k of the rest, at the same FFN share as top-25%."""
    windows = make_windows(dense.tokenizer.encode(text, add_special_tokens=False), args.seq_len,
                           max_windows=args.windows)  # fmt: skip
    base = perplexity(dense, windows, use_tqdm=False).perplexity
    split, experts, shared, k = args.splits.split(",")[0], args.shared_experts, args.shared_neurons, args.shared_top_k
    llm, stats, seconds = moefied(args, split, "ridge", samples, experts, shared)
    width = llm.llm_engine.model.config.intermediate_size
    share = (shared + k * (width - shared) // experts) / width
    ((routed, oracle),) = sweep(llm, [k / experts], experts, windows, oracle=True).values()
    return "\n".join(
        [
            f"Shared expert: the {shared} neurons with the largest mean squared activation on the calibration tokens "
            f"always on, the other {width - shared} split ({split}) into {experts} experts of which the top {k} run: "
            f"{share:.0%} of the FFN per token. Same perplexity protocol and calibration as above ({seconds:.0f} s). "
            f"Command: `python benchmarks/moefy_bench.py {' '.join(sys.argv[1:])}`.",
            "",
            "| model | perplexity, ridge router | oracle routing | router recall of oracle top-k (calibration) |",
            "|---|---:|---:|---:|",
            f"| dense | {base:.2f} | | |",
            f"| shared {shared} + top {k} of {experts} | {routed:.2f} ({routed / base - 1:+.0%}) | "
            f"{oracle:.2f} ({oracle / base - 1:+.0%}) | {stats['router recall of oracle top-k']:.1%} |",
        ]
    )


def decode(args, dense, samples, text) -> str:
    """Batch-1 decode of the dense model (native loop and per-layer path) and the top-25% MoE, and where the
    per-layer path spends its time."""
    quarter = max(1, round(0.25 * args.experts))
    split = args.splits.split(",")[0]
    moe, _, _ = moefied(args, split, "ridge", samples)
    same_path = leanlm_llm(args.model, 4, dequantize=True)
    same_path.llm_engine.model.allow_native_decode = False
    cut = leanlm_llm(args.model, 4, dequantize=True)
    cut_ffn(cut, quarter / args.experts)
    runners = {
        "dense bf16 (native decode loop)": LeanLMRunner(dense),
        "dense bf16 (per-layer path)": LeanLMRunner(same_path),
        f"MoE {quarter}/{args.experts} ({split} split, native loop)": LeanLMRunner(moe),
        f"FFN cut to {quarter}/{args.experts}, no router (native loop)": LeanLMRunner(cut),
    }
    prompts = prompts_from_text(dense.tokenizer, text, [16] * (4 * args.reps + 2), seed=0)
    for runner in runners.values():
        runner.latency(prompts[-1], 8)  # warm-up: kernels, native loop
    reps = timed(runners, prompts, args.output_len, args.reps, args.max_other_cpu)
    profiles = {name: layer_profile(r.llm, prompts[-2], args.output_len) for name, r in runners.items()
                if "native" not in name}  # fmt: skip
    assert cut.llm_engine.model.native_decode_plan().loop is not None, "the cut model left the native loop"
    return render_decode(args, reps, profiles, ffn_share(dense.llm_engine.model), quarter)


def render_quality(args, base, results, stats, seconds) -> str:
    command = f"python benchmarks/moefy_bench.py {' '.join(sys.argv[1:])}"
    lines = [
        f"MoEfication of {Path(args.model).name} into {args.experts} experts per layer. Perplexity: WikiText-2 raw "
        f"test, {args.windows} x {args.seq_len} tokens ({args.windows * (args.seq_len - 1)} scored), bf16. "
        f"Calibration: {args.calib_samples} x {args.calib_len} tokens of gensim's Wikipedia articles (4096 of them "
        f"fit the router and the co-activation split). Machine: {describe_machine()}, {args.threads} torch "
        f"thread(s); other agents were running on it. Command: `{command}`.",
        "",
        "| split, router | " + " | ".join(f"top {float(f):.0%}" for f in args.fractions.split(",")) + " |",
        "|---|" + "---:|" * len(args.fractions.split(",")),
        f"| dense | {base:.2f} |" + " |" * (len(args.fractions.split(",")) - 1),
    ]
    for name, sweep_ in results.items():
        cells = [f"{r:.2f} ({r / base - 1:+.0%})" for r, _ in sweep_.values()]
        cells += ["-"] * (len(args.fractions.split(",")) - len(cells))
        router = "" if "router" in name else ", ridge router"
        lines.append(f"| {name}{router} | " + " | ".join(cells) + " |")
        if any(o is not None for _, o in sweep_.values()):
            cells = ["-" if o is None else f"{o:.2f} ({o / base - 1:+.0%})" for _, o in sweep_.values()]
            cells += ["-"] * (len(args.fractions.split(",")) - len(cells))
            lines.append(f"| {name}, oracle routing | " + " | ".join(cells) + " |")
    lines += ["", "MoEfication took " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + " (compress on CPU)."]
    lines += ["", "On the calibration tokens, mean over layers, top-25% of experts:", ""]
    lines += ["| split | " + " | ".join(next(iter(stats.values()))) + " |", "|---|" + "---:|" * 5]
    lines += [f"| {s} | " + " | ".join(f"{v:.1%}" for v in st.values()) + " |" for s, st in stats.items()]
    return "\n".join(lines)


def render_decode(args, reps, profiles, share, quarter) -> str:
    lines = [
        f"Machine: {describe_machine()}, {args.threads} torch thread(s); other agents were running on it. "
        f"Command: `python benchmarks/moefy_bench.py {' '.join(sys.argv[1:])}`."
    ]
    tpot = {name: median(r.values) for name, r in reps.items()}
    first = next(iter(tpot))
    lines += [
        "",
        f"Batch-1 greedy decode, bf16, {args.output_len} new tokens after 16-token prompts, {args.reps} repetitions "
        f"alternating (median time per output token); the FFN is {share:.0%} of the weight bytes a dense step reads, "
        f"so top-{quarter} of {args.experts} reads {1 - 0.75 * share:.0%} of them (bandwidth bound: "
        f"{1 / (1 - 0.75 * share):.2f}x at best).",
        "",
        "| engine | TPOT ms | tokens/s | vs dense native | other CPU per kept rep | discarded reps (other CPU) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, r in reps.items():
        others = ", ".join(f"{o:.0%}" for o in r.other_shares)
        lines.append(
            f"| {name} | {tpot[name] * 1e3:.2f} | {1 / tpot[name]:.1f} | {tpot[first] / tpot[name]:.2f}x | "
            f"{others} | {len(r.discarded)} ({', '.join(f'{o:.0%}' for o in r.discarded)}) |"
        )
    moe_name = list(tpot)[2]
    speed = tpot[first] / tpot[moe_name]
    verdict = "met" if speed >= TARGET_SPEEDUP else "not met"
    lines += ["", f"Target (issue 37): >= {TARGET_SPEEDUP}x dense at 25% of the FFN: {speed:.2f}x, {verdict}."]
    kinds = ["attention", "norms", "MLP block", "  router", "  experts", "step (all)"]
    lines += ["", "Per-layer path, ms per decoded token summed over layers (forward hooks, one decode run each):", ""]
    lines += ["| module | " + " | ".join(profiles) + " |", "|---|" + "---:|" * len(profiles)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{p.get(kind, 0):.2f}" for p in profiles.values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
