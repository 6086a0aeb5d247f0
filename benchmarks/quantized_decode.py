"""Batch-1 decode speed of quantized models in one run: our bfloat16, int8 weight-only and int4 (group 64)
engines next to llama.cpp running its own Q8_0 and Q4_1 of the same model (llama-cpp-python, in process).

    python benchmarks/quantized_decode.py --doc docs/quantization.md

Every layer and the output head are quantized in our int8/int4 checkpoints, as in llama.cpp's files (the
int4 checkpoint keeps the head at int8, as llama.cpp's Q4_1 file keeps it at Q8_0; a second int4 row has it at
int4 too). Each repetition records
the CPU share other processes took (from /proc/stat) and contaminated repetitions are discarded.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import torch

from leanlm.analysis.bench import LeanLMRunner, LlamaCppRunner, median, repeat
from leanlm.analysis.bench_suite import prompts_from_text
from leanlm.analysis.host import describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.analysis.peers import find_llama_server
from leanlm.compress import RTNConfig, SmoothQuantConfig, compress
from leanlm.compress.calibration import calibration_samples, read_calibration_text
from leanlm.data import wikitext2_test_path
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.stored import read_checkpoint
from leanlm.llm import LLM
from leanlm.loading.registry import resolve_model
from leanlm.model.llama import build_model

WIKITEXT = wikitext2_test_path()  # packaged with leanlm (leanlm/data)
RECIPES = {
    "int8": [RTNConfig(bits=8, group_size=None, ignore=())],
    "int4": [RTNConfig(bits=4, group_size=64), RTNConfig(bits=8, group_size=None, ignore=())],  # head at int8
    "int4-head4": [RTNConfig(bits=4, group_size=64, ignore=())],  # the head at int4 too
    # SmoothQuant W8A8 (per-token int8 activations on the VNNI kernel), the head int8 weight-only
    "w8a8": [SmoothQuantConfig(alpha=0.5), RTNConfig(bits=8, group_size=None, act_bits=8)]
    + [RTNConfig(bits=8, group_size=None, ignore=())],
}
CALIBRATED = {"w8a8"}  # recipes that need calibration text (the packaged default, 64 windows of 256 tokens)


def quantized_dir(model: str, kind: str, root: Path) -> Path:
    out = root / f"{Path(model).name}-{kind}"
    if not (out / "quantization_config.json").is_file():
        ckpt = read_checkpoint(model, progress=False)
        net = build_model(ckpt.config, ckpt.state_dict, torch.float32)
        samples = None
        if kind in CALIBRATED:
            ids = ckpt.tokenizer.encode(read_calibration_text(None), add_special_tokens=False)
            samples = calibration_samples(ids, 64, 256)
        compress(net, RECIPES[kind], samples, progress=False)
        save_checkpoint(Checkpoint(net, ckpt.tokenizer), out)
    return out


def llama_q8_0(gguf: Path, root: Path) -> Path | None:
    """llama.cpp's own Q8_0 of the model, made by its llama-quantize (built next to llama-server)."""
    out = root / (gguf.stem.split(".")[0] + ".Q8_0.gguf")
    server = find_llama_server()
    tool = server.parent / "llama-quantize" if server else None
    if not out.is_file() and tool is not None and tool.is_file():
        subprocess.run([str(tool), "--allow-requantize", str(gguf), str(out), "Q8_0"], check=True, capture_output=True)
    return out if out.is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--work-dir", default="bench-results/quantized-decode")
    ap.add_argument("--doc", default=None)
    args = ap.parse_args()
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    gguf = resolve_model(args.model)
    runners: dict[str, object] = {
        "leanlm bf16": LeanLMRunner(LLM(args.model, dtype="bfloat16", progress=False)),
        "leanlm int8 weight-only": LeanLMRunner(
            LLM(str(quantized_dir(args.model, "int8", root)), dtype="bfloat16", progress=False)
        ),
        "leanlm int4 g64": LeanLMRunner(
            LLM(str(quantized_dir(args.model, "int4", root)), dtype="bfloat16", progress=False)
        ),
        "leanlm int4 g64, head int4": LeanLMRunner(
            LLM(str(quantized_dir(args.model, "int4-head4", root)), dtype="bfloat16", progress=False)
        ),
    }
    ctx = args.prompt_len + args.output_len + 16
    q8 = llama_q8_0(gguf, root)
    if q8 is not None:
        runners["llama.cpp Q8_0"] = LlamaCppRunner(q8, ctx)
    runners[f"llama.cpp {gguf.stem.split('.')[-1]} (as published)"] = LlamaCppRunner(gguf, ctx)
    tokenizer = runners["leanlm bf16"].llm.tokenizer
    prompts = prompts_from_text(tokenizer, WIKITEXT.read_text(), [args.prompt_len] * (args.reps + 1), seed=0)
    for r in runners.values():
        r.latency(prompts[0], 16)  # warm-up
    results = {}
    for name, r in runners.items():
        fresh = iter(prompts[1:])
        results[name] = repeat(
            lambda r=r, fresh=fresh: r.latency(next(fresh), args.output_len), args.reps, args.max_other_cpu
        )
        print(name, [round(s.tpot_s * 1000, 2) for s in results[name].values], flush=True)
    base = median([s.tpot_s for s in results["leanlm bf16"].values])
    lines = [
        f"Batch-1 decode of {args.model}: {args.prompt_len}-token prompts, {args.output_len} greedy tokens, "
        f"{args.reps} repetitions each (median), {torch.get_num_threads()} threads; repetitions during which "
        f"other processes took more than {args.max_other_cpu:.0%} of the CPU are discarded. Machine: "
        f"{describe_machine()}. Command: "
        f"`python benchmarks/quantized_decode.py --reps {args.reps}`.",
        "",
        "| engine | weights | TPOT ms | tokens/s | vs leanlm bf16 | kept / discarded reps |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, reps in results.items():
        tpot = median([s.tpot_s for s in reps.values])
        weights = name.split(" ", 1)[1]
        lines.append(
            f"| {name.split(' ')[0]} | {weights} | {tpot * 1000:.2f} | {1 / tpot:.1f} | "
            f"{base / tpot:.2f}x | {len(reps.values)} / {len(reps.discarded)} |"
        )
    report = "\n".join(lines)
    print(report)
    if args.doc:
        replace_section(Path(args.doc), f"speed-{Path(args.model).name}", report)


if __name__ == "__main__":
    main()
