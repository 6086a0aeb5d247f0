"""Batch-1 decode of the default model with every decoder linear in a sparse runtime format, next to the dense model
at the same weight precision, in one run (issue 17's target: 2:4 at least 1.25x the dense model's decode speed at the
same precision):

- bf16: dense, 2:4 (Sparse24Linear) and 70% unstructured (BitmaskSparseLinear);
- int8 per channel: dense (RTN) and 2:4 then RTN (Sparse24Int8Linear);
- int4 g64: dense (RTN) and 2:4 then RTN (Sparse24Int4Linear).

Every engine loads the bundled GGUF dequantized to bf16 (batched_decode's LeanLM engine, capped at one running
request) and is compressed in place through `compress`: magnitude pruning (every pruning method gives the same
layout, so the speed is the method's), then RTN where quantized. The embedding and the tied output head stay dense
bf16. Pruning without any recovery hurts quality: this measures speed only. Repetitions alternate between the
engines, each on a fresh prompt; repetitions during which other processes took more than --max-other-cpu of the
CPU (/proc/stat) are discarded and counted.

    python benchmarks/sparse_decode.py --out docs/sparse-decode.md
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from batched_decode import leanlm_llm  # benchmarks/: the engine options every LeanLM row uses
from tqdm import tqdm

from leanlm.analysis.bench import LeanLMRunner, Repetitions, median
from leanlm.analysis.bench_suite import prompts_from_text
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.compress import MagnitudeConfig, RTNConfig, compress
from leanlm.data import wikitext2_test_path
from leanlm.kernels import cpu_act_sparse, cpu_bitmask, cpu_gemv, cpu_qgemv, cpu_sparse
from leanlm.kernels.spec import MIN_PARALLEL_BYTES
from leanlm.llm import LLM
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.model.linear.act_sparse import ActSparseLinear
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.bitmask import BitmaskSparseLinear
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.linear.sparse24_quant import Sparse24Int4Linear, Sparse24Int8Linear

TARGET = 1.25  # issue 17: 2:4 sparse decode at least this much faster than dense at the same precision
INT8, INT4 = RTNConfig(bits=8, group_size=None), RTNConfig(bits=4, group_size=64)
PRUNE_24 = MagnitudeConfig(pattern="2:4")


@dataclass(frozen=True)
class Variant:
    """One engine of the table: its recipe, the loop kind batch-1 decode must run on, its dense baseline."""

    recipe: tuple
    kind: str  # the few-row kernel's name (NativeLinear.name)
    baseline: str


VARIANTS = {
    "dense bf16": Variant((), "bf16", "dense bf16"),
    "2:4 bf16": Variant((PRUNE_24,), "sparse24", "dense bf16"),
    "70% unstructured bf16": Variant((MagnitudeConfig(sparsity=0.7),), "bitmask", "dense bf16"),
    "dense int8": Variant((INT8,), "int8", "dense int8"),
    "2:4 int8": Variant((PRUNE_24, INT8), "sparse24_int8", "dense int8"),
    "dense int4 g64": Variant((INT4,), "int4", "dense int4 g64"),
    "2:4 int4 g64": Variant((PRUNE_24, INT4), "sparse24_int4", "dense int4 g64"),
}


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder linears' weights as decode reads them (values + mask for 2:4; bias excluded)."""
    total = 0
    for layer in model.model.layers:
        for module in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(module, RuntimeLinear):
                total += module.weight_bytes()
            elif isinstance(module, torch.nn.Linear):
                total += module.weight.numel() * module.weight.element_size()
    return total


def loop_kinds(model: torch.nn.Module) -> set[str]:
    """The few-row kernels (by name) of the native decode loop batch-1 decode runs on (empty: no loop)."""
    loop = model.native_decode_plan().loop
    return set() if loop is None else {linear.name for layer in loop._keep[0] for linear in layer.linears}


def decoder_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for layer in model.model.layers for m in (*layer.self_attn.children(), *layer.mlp.children())]


def kernel_call(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, threads: int):
    """A zero-argument call of the C kernel the decode loop runs for `module` on x [M, K] into y [M, N] (no bias,
    as SmolLM2's), skipping the Python wrappers' checks so small products are timed as the loop runs them."""
    group = getattr(module, "group_size", None) or module.in_features  # for the kernels that take one
    if isinstance(module, ActSparseLinear):  # its threshold is a double among the pointers
        fn, M, (N, K) = cpu_act_sparse._KERNEL.fn(), x.shape[0], (module.out_features, module.in_features)
        args = (x.data_ptr(), module.weight_t.data_ptr(), module.threshold_value, module.column_scale.data_ptr())
        return lambda: fn(*args, None, y.data_ptr(), M, N, K, threads, MIN_PARALLEL_BYTES)
    if isinstance(module, Sparse24Linear):
        fn, tensors, group = cpu_sparse._KERNEL.fn(), (module.values, module.mask), None
    elif isinstance(module, BitmaskSparseLinear):
        fn, tensors, group = cpu_bitmask._KERNEL.fn(), (module.values, module.mask, module.row_offsets), None
    elif isinstance(module, Sparse24Int8Linear):
        fn, tensors = cpu_sparse._INT8_KERNEL.fn(), (module.codes, module.mask, module.scales)
    elif isinstance(module, Sparse24Int4Linear):
        fn, tensors = cpu_sparse._INT4_KERNEL.fn(), (module.codes, module.mask, module.scales, module.zeros)
    elif isinstance(module, Int8WeightOnlyLinear):
        fn, tensors = cpu_qgemv._INT8_KERNEL.fn(), (module.qweight, module.scales)
    elif isinstance(module, IntGroupWeightOnlyLinear):
        fn, tensors = cpu_qgemv._INT4_KERNEL.fn(), (module.qweight, module.scales, module.mins)
    else:
        fn, tensors, group = cpu_gemv._KERNEL.fn(), (module.weight,), None
    sizes = (x.shape[0], module.out_features, module.in_features) + (() if group is None else (group,))
    pointers = [x.data_ptr()] + [t.data_ptr() for t in tensors] + [None, y.data_ptr()]  # None: no bias
    return lambda: fn(*pointers, *sizes, threads, MIN_PARALLEL_BYTES)  # the caller keeps x, y and module alive


def median_pass_times(passes: dict, max_other: float, repeats: int = 21) -> dict:
    """Median seconds of each pass (a list of calls run in order), over `repeats` rounds alternating between the
    passes; rounds during which other processes took more than max_other of the CPU are left out."""
    times: dict = {key: [] for key in passes}
    for _ in range(repeats):
        for key, calls in passes.items():
            with CpuMonitor() as monitor:
                t0 = time.perf_counter()
                for call in calls:
                    call()
                elapsed = time.perf_counter() - t0
            if not monitor.sample.is_contaminated(max_other):
                times[key].append(elapsed)
    return {key: median(t) for key, t in times.items()}


def chain_table(models: dict[str, torch.nn.Module], rows: list[int], max_other: float) -> list[str]:
    """The products alone: every decoder linear of each model once per pass (the weights of one decode step, from
    DRAM), on the kernels the loop calls, median of 21 passes alternating between models, passes during which
    other processes took more than max_other of the CPU left out; the ratio is against the model's baseline."""
    threads = torch.get_num_threads()
    head = "| model | " + " | ".join(f"{M} row{'s' if M > 1 else ''}: ms, vs baseline" for M in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]
    cells: dict[str, list[str]] = {name: [] for name in models}
    for M in rows:
        passes = {}
        for name, model in models.items():
            linears = decoder_linears(model)
            xs = {m.in_features: torch.randn(M, m.in_features).bfloat16() for m in linears}
            ys = {m.out_features: torch.empty(M, m.out_features, dtype=torch.bfloat16) for m in linears}
            calls = [kernel_call(m, xs[m.in_features], ys[m.out_features], threads) for m in linears]
            passes[name] = (calls, xs, ys)  # the calls hold raw pointers: keep their tensors alive
        med = median_pass_times({name: calls for name, (calls, _, _) in passes.items()}, max_other)
        for name in models:
            base = med[VARIANTS[name].baseline]
            cells[name].append(f"{med[name] * 1e3:.2f}, {base / med[name]:.2f}x")
    lines += [f"| {name} | " + " | ".join(c) + " |" for name, c in cells.items()]
    return lines


SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))  # SmolLM2's q/o, k/v, gate/up, down (N x K)


def sparsity_sweep(levels: list[float], max_other: float, copies: int = 60) -> list[str]:
    """The unstructured (bitmask) kernel against the dense bf16 GEMV per SmolLM2 shape and fraction of zeros, batch
    1: `copies` random weights of each shape cycled (so they come from DRAM, as in decode), magnitude-pruned per row,
    median of 21 passes alternating, contaminated passes left out. Where BitmaskSparseLinear.MIN_SPARSITY comes from."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    lines = ["| shape (N x K) | " + " | ".join(f"{s:.0%} zeros" for s in levels) + " |"]
    lines.append("|---|" + "---:|" * len(levels))
    for n, k in SHAPES:
        x, y = torch.randn(1, k, generator=gen).bfloat16(), torch.empty(1, n, dtype=torch.bfloat16)
        weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(copies)]
        layers = {"dense": [_dense_linear(w) for w in weights]}
        for s in levels:
            cut = int(s * k)
            layers[s] = [BitmaskSparseLinear.from_dense(_prune_rows(w, cut)) for w in weights]
        calls = {key: [kernel_call(m, x, y, threads) for m in ms] for key, ms in layers.items()}
        med = median_pass_times(calls, max_other)
        dense = med["dense"]
        cells = [f"{med[s] / copies * 1e6:.1f} us, {dense / med[s]:.2f}x" for s in levels]
        lines.append(f"| {n} x {k} (dense {dense / copies * 1e6:.1f} us) | " + " | ".join(cells) + " |")
    return lines


def _dense_linear(w: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    linear.weight.data = w
    return linear


def _prune_rows(w: torch.Tensor, cut: int) -> torch.Tensor:
    """w with the `cut` smallest |w| of every row zeroed."""
    drop = w.float().abs().argsort(dim=1)[:, :cut]
    return w.scatter(1, drop, 0.0)


def build(model_path: str, variant: Variant) -> LLM:
    """The engine of one variant: the dense bf16 model compressed in place by its recipe."""
    llm = leanlm_llm(model_path, 1, dequantize=True)
    if variant.recipe:
        compress(llm.llm_engine.model, list(variant.recipe), progress=False)
    return llm


def verdicts(tpot: dict[str, float], variants: dict[str, Variant]) -> list[str]:
    """Issue 17's target for each 2:4 row, against the dense model at its precision."""
    lines = ["", f"Target (issue 17): 2:4 >= {TARGET}x the dense model at the same precision, batch 1:"]
    for name in (n for n in variants if n.startswith("2:4")):
        speedup = tpot[variants[name].baseline] / tpot[name]
        if speedup != speedup:  # NaN: an engine kept no repetition
            verdict = "not measured (every repetition of an engine was discarded: rerun on a quieter machine)"
        else:
            verdict = f"{speedup:.2f}x, " + ("met" if speedup >= TARGET else "not met")
        lines.append(f"- {name}: {verdict}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--out", default=None, help="markdown file whose sparse-decode section gets the table")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="a subset to time")
    args = ap.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants}
    if not {"dense bf16", *(v.baseline for v in variants.values())} <= set(variants):
        raise SystemExit("every variant needs its dense baseline (and dense bf16) among --variants")
    if not (cpu_sparse.is_available() and cpu_sparse.quant_is_available() and cpu_bitmask.is_available()):
        reason = cpu_sparse.unavailable_reason() or cpu_bitmask.unavailable_reason()
        raise SystemExit(f"the sparse kernels are unavailable here ({reason}): nothing to time")

    engines = {name: build(args.model, variant) for name, variant in tqdm(variants.items(), desc="engines")}
    runners = {name: LeanLMRunner(llm) for name, llm in engines.items()}
    tokenizer = engines["dense bf16"].tokenizer
    text = wikitext2_test_path().read_text()
    prompts = prompts_from_text(tokenizer, text, [args.prompt_len] * (args.reps + 1), seed=0)
    for runner in runners.values():
        runner.latency(prompts[0], 16)  # warm-up: kernels compiled, native loop built
    for name, llm in engines.items():  # each decodes on its own kernel inside the native loop
        kinds = loop_kinds(llm.llm_engine.model)
        assert kinds == {variants[name].kind}, (name, kinds)

    results = {name: Repetitions() for name in runners}
    for rep in range(args.reps):  # alternate, so drift in machine load hits every engine alike
        for name, runner in runners.items():
            with CpuMonitor() as monitor:
                sample = runner.latency(prompts[rep + 1], args.output_len)
            results[name].add(sample, monitor.sample, args.max_other_cpu)
            print(f"{name}: {sample.decode_tokens_per_s:.1f} tok/s (others {monitor.sample.other_share:.0%})")

    tpot = {name: median([s.tpot_s for s in reps.values]) for name, reps in results.items()}
    lines = [
        f"Batch-1 greedy decode of {Path(args.model).name}: {args.prompt_len}-token prompts (WikiText-2), "
        f"{args.output_len} new tokens, {args.reps} repetitions per engine alternating (median time per output "
        f"token); repetitions during which other processes took more than {args.max_other_cpu:.0%} of the CPU "
        "are discarded. Every decoder linear (210) is magnitude-pruned (2:4, or 70% of each row) and, for int8 / "
        "int4, then quantized by RTN (int8 per channel, int4 in groups of 64); the embedding and tied head stay "
        "dense bf16. Every engine decodes in the native loop on its format's kernel. "
        f"Machine: {describe_machine()}. Command: `python benchmarks/sparse_decode.py --reps {args.reps}`.",
        "",
        "| model | decoder linear weights MB | TPOT ms | tokens/s | vs dense, same precision | vs dense bf16 | "
        "kept / discarded reps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, reps in results.items():
        mb = linear_bytes(engines[name].llm_engine.model) / 1e6
        same = tpot[VARIANTS[name].baseline] / tpot[name]
        lines.append(
            f"| {name} | {mb:.1f} | {tpot[name] * 1000:.2f} | {1 / tpot[name]:.1f} | {same:.2f}x | "
            f"{tpot['dense bf16'] / tpot[name]:.2f}x | {len(reps.values)} / {len(reps.discarded)} |"
        )
    lines += verdicts(tpot, variants)
    models = {name: llm.llm_engine.model for name, llm in engines.items()}
    lines += ["", "The decoder linears alone (one pass = every product of a decode step, weights from DRAM; the"]
    lines += ["ratio is against the dense model at the same precision):", ""]
    lines += chain_table(models, [1, 4, 8], args.max_other_cpu)
    levels = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    lines += [
        "",
        "The unstructured kernel alone by fraction of zeros (batch 1, 60 random weights of each shape cycled,",
    ]
    lines += ["magnitude-pruned per row; time per product and speedup over the dense bf16 GEMV):", ""]
    lines += sparsity_sweep(levels, args.max_other_cpu)
    report = "\n".join(lines)
    print(report)
    if args.out:
        replace_section(Path(args.out), "sparse-decode", report)


if __name__ == "__main__":
    main()
