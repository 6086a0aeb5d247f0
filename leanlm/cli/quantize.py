"""`leanlm quantize`: build the method's recipe from the flags and run it as a CompressJob (load in float32,
calibrate, compress, save), printing its summary (size before and after, per-layer error)."""

from __future__ import annotations

import argparse
from pathlib import Path

from leanlm.compress.named_recipes import QUANTIZE_METHODS as METHODS
from leanlm.compress.named_recipes import build_recipe


def add_parser(sub) -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    p = sub.add_parser("quantize", help="quantize a model (RTN, GPTQ, AWQ, SmoothQuant, LLM.int8(), FP8) and save it")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    p.add_argument("--method", choices=METHODS, required=True, help="compression method (docs/quantization.md)")
    p.add_argument("--bits", type=int, default=None, help="weight bits (default: 4; 8 for smoothquant/llm_int8/fp8)")
    p.add_argument(
        "--group-size", type=int, default=None, help="columns per scale (default 64 below 8 bits); 0 = per channel"
    )
    p.add_argument("--act-bits", type=int, default=None, help="8: also quantize activations per token (W8A8)")
    p.add_argument(
        "--symmetric",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="symmetric weights (default: yes at 8 bits, zero points below)",
    )
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    p.add_argument("--threshold", type=float, default=6.0, help="LLM.int8() outlier threshold")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True, help="GPTQ act-order")
    p.add_argument(
        "--true-sequential",
        action="store_true",
        help="GPTQ: fit o_proj to the quantized q/k/v and down_proj to the quantized gate/up (about "
        "+20%% calibration time)",
    )
    p.add_argument(
        "--static-groups",
        action="store_true",
        help="GPTQ act-order with each group's scale fixed in input order: no permutation is stored (what QAT "
        "and the 2:4 int4 format need)",
    )
    p.add_argument("--quantize-lm-head", action="store_true", help="also quantize the output head")
    add_calibration_args(p, "GPTQ, AWQ, SmoothQuant, LLM.int8()")
    p.add_argument(
        "--format",
        choices=["leanlm", "gptq"],
        default="leanlm",
        help="gptq: the qweight/qzeros/scales/g_idx layout HF transformers and vLLM read (4-bit only)",
    )
    add_output_args(p)
    p.set_defaults(func=cmd_quantize)


def add_calibration_args(p, users: str) -> None:
    """--calib, --num-samples, --seq-len, --seed: the calibration text and its windows (CompressJob's)."""
    p.add_argument("--calib", default=None, help="calibration text (default: gensim's Wikipedia articles)")
    p.add_argument("--num-samples", type=int, default=64, help=f"calibration windows ({users})")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--seed", type=int, default=0, help="seeds the calibration windows' positions in the text")


def add_output_args(p) -> None:
    p.add_argument("--out", required=True, help="output directory (empty or new, unless --overwrite)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out directory (never the --model or --calib it reads)",
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")


def cmd_quantize(args: argparse.Namespace) -> int:
    recipe = build_recipe(
        args.method,
        args.bits,
        args.group_size,
        args.act_bits,
        args.alpha,
        args.threshold,
        args.act_order,
        args.symmetric,
        args.quantize_lm_head,
        args.true_sequential,
        args.static_groups,
    )
    return run_job(args, recipe, args.format)


def run_job(args: argparse.Namespace, recipe, fmt: str) -> int:
    """The CompressJob of the shared flags (checked before anything loads), run, its summary printed
    (`leanlm quantize` and `leanlm prune`)."""
    from leanlm.compress.jobs import CompressJob, run_compress

    job = CompressJob(
        out=Path(args.out),
        recipe=tuple(recipe),
        model=args.model,
        format=fmt,
        calib=args.calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        seed=args.seed,
        device=args.device,
        overwrite=args.overwrite,
    )
    print(run_compress(job).summary)
    return 0
