"""Quantization quality in one run: every method's WikiText-2 perplexity and KL divergence against the float
model, on one model, calibrated on other text (gensim's Wikipedia articles).

    python benchmarks/quantization.py --model smollm2-135m-instruct --doc docs/quantization.md

Each configuration is quantized from the float32 model, saved as a checkpoint, loaded back through
`LLM(dir)` (the path users take) and scored in bfloat16; KV-cache rows change only the engine's cache.
Rows are kept in <results-dir>/<model>/results.json: a rerun of some configurations with the same settings
replaces those rows and keeps the others, so the table can be built over several runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leanlm.analysis.eval import kl_divergence, make_windows, perplexity, read_text
from leanlm.analysis.host import describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.analysis.sparsity import linear_sparsity, overall
from leanlm.compress import calibration_samples, compress, read_calibration_text
from leanlm.compress.base import MethodConfig, build_method
from leanlm.compress.jobs import directory_bytes, model_bytes
from leanlm.compress.named_recipes import build_recipe
from leanlm.data import wikitext2_test_path
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.stored import read_checkpoint
from leanlm.llm import LLM
from leanlm.model.llama import build_model

WIKITEXT = wikitext2_test_path()  # packaged with leanlm (leanlm/data)

# name -> (CLI method, options for build_recipe) or a KV-cache dtype
CONFIGS: dict[str, dict] = {
    "W8A16 RTN (int8 weight-only)": dict(method="rtn", bits=8),
    "LLM.int8() (threshold 6)": dict(method="llm_int8"),
    "KV cache int8": dict(kv_cache_dtype="int8"),
    "KV cache fp8 e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "W8A8 RTN (per-token acts)": dict(method="rtn", bits=8, act_bits=8),
    "W8A8 SmoothQuant a=0.5": dict(method="smoothquant", alpha=0.5),
    "W8A8 ZeroQuant g64": dict(method="zeroquant", group_size=64),
    "FP8 W8A8 e4m3": dict(method="fp8"),
    "W4A16 g64 RTN": dict(method="rtn", bits=4),
    "W4A16 g64 GPTQ": dict(method="gptq", bits=4),
    "W4A16 g64 AWQ": dict(method="awq", bits=4),
    "W3A16 g64 RTN": dict(method="rtn", bits=3),
    "W3A16 g64 GPTQ": dict(method="gptq", bits=3),
    "W3A16 g64 AWQ": dict(method="awq", bits=3),
    "LLM.int8() (threshold 4)": dict(method="llm_int8", threshold=4.0),
    "LLM.int8() (threshold 3)": dict(method="llm_int8", threshold=3.0),
    # where LLM.int8()'s loss comes from: every linear but down_proj, then down_proj alone
    "LLM.int8() except down_proj": dict(method="llm_int8", ignore=("lm_head", "down_proj")),
    "LLM.int8() down_proj only": dict(
        method="llm_int8", ignore=("lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
    ),
}


@dataclass
class Row:
    config: str
    recipe: str
    weights_mib: float
    quantize_s: float
    perplexity: float
    delta_pct: float
    mean_kl: float
    top1_agreement: float
    sparsity: float = 0.0  # fraction of the decoder linears' weights that are exactly zero
    notes: str = ""  # what the methods measured besides (channel permutation: kept-score gains)


def quant_recipe(opts: dict) -> list[MethodConfig]:
    """A CONFIGS entry's recipe: build_recipe's options, plus an optional `ignore` for every step."""
    opts = dict(opts)
    ignore = opts.pop("ignore", None)
    recipe = build_recipe(**opts)
    return recipe if ignore is None else [dataclasses.replace(c, ignore=ignore) for c in recipe]


@dataclass(frozen=True)
class Study:
    """What one quality script compares: its configurations, how each becomes a recipe, where rows go."""

    configs: dict[str, dict]
    recipe_of: Callable[[dict], list[MethodConfig]]
    script: str  # the command line's script, for the report
    results_dir: str
    verb: str  # "Quantized", "Pruned": how the report says the checkpoints were made
    time_label: str  # the table's column of compression seconds


QUANTIZATION = Study(
    CONFIGS, quant_recipe, "benchmarks/quantization.py", "bench-results/quantization", "Quantized", "quantize s"
)


def main(study: Study = QUANTIZATION, description: str = __doc__) -> None:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--configs", default=",".join(study.configs), help="comma-separated names from CONFIGS")
    ap.add_argument("--data", default=str(WIKITEXT))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ppl-windows", type=int, default=8, help="first K windows of the test set for perplexity")
    ap.add_argument("--kl-windows", type=int, default=2, help="first K windows for KL divergence")
    ap.add_argument("--num-samples", type=int, default=64, help="calibration samples")
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--results-dir", default=study.results_dir)
    ap.add_argument("--doc", default=None, help="markdown file whose section quality-<model> gets the table")
    args = ap.parse_args()
    args.study = study
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in study.configs]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(study.configs)}")

    ckpt = read_checkpoint(args.model, progress=False)
    ids = ckpt.tokenizer.encode(read_text(args.data), add_special_tokens=False)
    windows = make_windows(ids, args.seq_len, None, max(args.ppl_windows, args.kl_windows))
    ppl_windows, kl_windows = windows[: args.ppl_windows], windows[: args.kl_windows]
    calib_text = read_calibration_text()
    samples = calibration_samples(
        ckpt.tokenizer.encode(calib_text, add_special_tokens=False), args.num_samples, args.calib_seq_len
    )
    base = LLM(args.model, dtype="bfloat16", progress=False)
    base_ppl = perplexity(base, ppl_windows, use_tqdm=False).perplexity
    float_mib = model_bytes(build_model(ckpt.config, ckpt.state_dict, torch.float32), torch.bfloat16) / 2**20
    results = Path(args.results_dir) / Path(args.model).name
    rows = earlier_rows(results / "results.json", settings(args))
    rows["bfloat16 (reference)"] = Row("bfloat16 (reference)", "-", float_mib, 0.0, base_ppl, 0.0, 0.0, 1.0)
    print(rows["bfloat16 (reference)"], flush=True)
    for name in names:
        opts = dict(study.configs[name])
        start = time.perf_counter()
        zeros, notes = 0.0, ""
        if "kv_cache_dtype" in opts:
            llm, recipe, mib = LLM(args.model, dtype="bfloat16", progress=False, **opts), "-", float_mib
            seconds = 0.0
        else:
            recipe_cfgs = study.recipe_of(opts)
            model = build_model(ckpt.config, ckpt.state_dict, torch.float32)
            needs_data = any(build_method(c).needs for c in recipe_cfgs)
            report = compress(model, recipe_cfgs, samples if needs_data else None, progress=False)
            seconds = time.perf_counter() - start
            notes = "; ".join(
                f"{method}: " + ", ".join(f"{k} {v:+.2%}" for k, v in details.items())
                for method, details in report.details.items()
            )
            zeros = overall(linear_sparsity(model))
            out = results / name.replace(" ", "_").replace("/", "-")
            shutil.rmtree(out, ignore_errors=True)
            save_checkpoint(Checkpoint(model, ckpt.tokenizer), out)
            mib = directory_bytes(out) / 2**20
            recipe = " + ".join(c.name for c in recipe_cfgs)
            del model
            llm = LLM(str(out), dtype="bfloat16", progress=False)
        ppl = perplexity(llm, ppl_windows, use_tqdm=False).perplexity
        kl = kl_divergence(base, llm, kl_windows, windows_per_batch=1, use_tqdm=False)
        delta = 100 * (ppl / base_ppl - 1)
        rows[name] = Row(name, recipe, mib, seconds, ppl, delta, kl.mean_kl, kl.top1_agreement, zeros, notes)
        print(rows[name], flush=True)
        del llm
        write(args, rows, len(ids), samples.shape, results)  # after every row: a long run keeps what it measured
    print(format_report(args, ordered(study, rows), len(ids), samples.shape))


def settings(args) -> dict:
    """What makes rows of two runs comparable (the configurations may differ)."""
    return {
        k: getattr(args, k)
        for k in ("model", "data", "seq_len", "ppl_windows", "kl_windows", "num_samples", "calib_seq_len")
    }


def earlier_rows(path: Path, current: dict) -> dict[str, Row]:
    """Rows of earlier runs with the same settings (a rerun of some configurations replaces just those)."""
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    if not isinstance(saved, dict) or saved.get("settings") != current:
        return {}
    return {r["config"]: Row(**r) for r in saved["rows"]}


def ordered(study: Study, rows: dict[str, Row]) -> list[Row]:
    """The reference first, then the study's configuration order."""
    rank = {name: i for i, name in enumerate(["bfloat16 (reference)", *study.configs])}
    return sorted(rows.values(), key=lambda r: rank.get(r.config, len(rank)))


def write(args, rows: dict[str, Row], num_tokens: int, calib_shape, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    saved = {"settings": settings(args), "rows": [asdict(r) for r in ordered(args.study, rows)]}
    (results / "results.json").write_text(json.dumps(saved, indent=2))
    if args.doc:
        report = format_report(args, ordered(args.study, rows), num_tokens, calib_shape)
        replace_section(Path(args.doc), f"quality-{Path(args.model).name}", report)


def format_report(args, rows: list[Row], num_tokens: int, calib_shape) -> str:
    sparse = any(r.sparsity > 0.01 for r in rows)
    noted = any(r.notes for r in rows)
    lines = [
        f"**{args.model}**: WikiText-2 raw test ({num_tokens} tokens), sequence length {args.seq_len}, perplexity "
        f"over the first {args.ppl_windows} windows, KL(float || {args.study.verb.lower()}) per token over the first "
        f"{args.kl_windows}; calibration {calib_shape[0]} x {calib_shape[1]} tokens of gensim's Wikipedia "
        f"articles. {args.study.verb} from float32, saved, reloaded with `LLM(dir)`, scored in bfloat16. "
        f"Machine: {describe_machine()}. Command: "
        f"`python {args.study.script} --model {args.model} --ppl-windows {args.ppl_windows} "
        f"--kl-windows {args.kl_windows} --num-samples {args.num_samples} --calib-seq-len {args.calib_seq_len}`.",
        "",
        f"| configuration | recipe | weights MiB | {args.study.time_label} | perplexity | vs bf16 | mean KL (nats) | "
        "top-1 agree |" + (" zeros |" if sparse else "") + (" notes |" if noted else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if sparse else "") + ("---|" if noted else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r.config} | {r.recipe} | {r.weights_mib:.1f} | {r.quantize_s:.0f} | {r.perplexity:.4f} | "
            f"{r.delta_pct:+.2f}% | {r.mean_kl:.5f} | {r.top1_agreement:.3f} |"
            + (f" {r.sparsity:.1%} |" if sparse else "")
            + (f" {r.notes} |" if noted else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
