"""`leanlm quantize`: load a model in float32, build the method's recipe, calibrate, compress, save, and
print a summary (size before and after, per-layer error)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from leanlm.compress.base import CompressionReport, MethodConfig
from leanlm.compress.quantize.fp8 import FP8Config
from leanlm.compress.quantize.gptq import GPTQConfig
from leanlm.compress.quantize.llm_int8 import LLMInt8Config
from leanlm.compress.quantize.rtn import RTNConfig
from leanlm.compress.transform.awq import AWQConfig
from leanlm.compress.transform.smoothquant import SmoothQuantConfig

METHODS = ("rtn", "gptq", "awq", "smoothquant", "llm_int8", "fp8", "zeroquant")
NEEDS_CALIBRATION = ("gptq", "awq", "smoothquant", "llm_int8")


def build_recipe(
    method: str,
    bits: int | None = None,
    group_size: int | None = None,
    act_bits: int | None = None,
    alpha: float = 0.5,
    threshold: float = 6.0,
    act_order: bool = True,
    symmetric: bool | None = None,
    quantize_lm_head: bool = False,
    true_sequential: bool = False,
    static_groups: bool = False,
) -> list[MethodConfig]:
    """The recipe behind each CLI method. group_size None = the method's default (64 below 8 bits, per
    channel at 8), 0 = per channel."""
    ignore = () if quantize_lm_head else ("lm_head",)
    if method in ("smoothquant", "zeroquant"):
        bits = bits or 8
    bits = bits or (8 if method in ("llm_int8", "fp8") else 4)
    if group_size is None:
        group_size = None if bits == 8 and method != "zeroquant" else 64
    elif group_size == 0:
        group_size = None
    scheme = dict(bits=bits, group_size=group_size, symmetric=symmetric, act_bits=act_bits, ignore=ignore)
    if method == "rtn":
        return [RTNConfig(**scheme)]
    if method == "gptq":
        return [GPTQConfig(**scheme, act_order=act_order, true_sequential=true_sequential, static_groups=static_groups)]
    if method == "awq":
        return [AWQConfig(**scheme), RTNConfig(**scheme)]
    if method == "smoothquant":
        return [SmoothQuantConfig(alpha=alpha, ignore=ignore), RTNConfig(**{**scheme, "act_bits": 8})]
    if method == "zeroquant":
        return [RTNConfig(**{**scheme, "act_bits": 8})]
    if method == "llm_int8":
        return [LLMInt8Config(threshold=threshold, ignore=ignore)]
    if method == "fp8":
        return [FP8Config(ignore=ignore)]
    raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


def check_output_format(fmt: str, recipe: list[MethodConfig]) -> None:
    """The GPTQ layout holds symmetric 4-bit weight-only codes: refuse anything else before the (long) run."""
    if fmt != "gptq":
        return
    last = recipe[-1]
    if not isinstance(last, (RTNConfig, GPTQConfig)) or last.bits != 4 or last.act_bits is not None:
        raise ValueError("--format gptq writes 4-bit weight-only layers: use --method gptq|rtn|awq --bits 4")
    if not last.symmetric:
        raise ValueError("--format gptq needs symmetric weights (the layout stores zero - 1): add --symmetric")


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
    """--calib, --num-samples, --seq-len, --seed: the calibration text and its windows (`run_recipe`)."""
    p.add_argument("--calib", default=None, help="calibration text (default: gensim's Wikipedia articles)")
    p.add_argument("--num-samples", type=int, default=64, help=f"calibration windows ({users})")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--seed", type=int, default=0, help="seeds the calibration windows' positions in the text")


def add_output_args(p) -> None:
    p.add_argument("--out", required=True, help="output directory")
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
    )  # validates before loading
    check_output_format(args.format, recipe)
    return run_recipe(args, recipe, args.method in NEEDS_CALIBRATION, args.format)


def run_recipe(args: argparse.Namespace, recipe: list[MethodConfig], needs_calibration: bool, fmt: str) -> int:
    """Load args.model in float32, calibrate on args.calib (when the recipe needs data or --calib is given),
    compress, save to args.out in `fmt`, print the summary (`leanlm quantize` and `leanlm prune`)."""
    from leanlm.compress.calibration import calibration_samples, read_calibration_text
    from leanlm.compress.recipe import compress
    from leanlm.formats import (
        load_checkpoint,
        save_checkpoint,
        save_compressed_tensors_checkpoint,
        save_gptq_checkpoint,
    )

    if args.calib is not None and not Path(args.calib).is_file():
        raise ValueError(f"calibration file {args.calib} does not exist; pass a text file (or a MediaWiki .bz2 dump)")
    ckpt = load_checkpoint(args.model, "float32", args.device or None)
    model = ckpt.model
    samples = None
    if needs_calibration or args.calib:
        text = read_calibration_text(args.calib)
        ids = ckpt.tokenizer.encode(text, add_special_tokens=False)
        samples = calibration_samples(ids, args.num_samples, args.seq_len, args.seed)
    bytes_before = model_bytes(model, torch.bfloat16)
    report = compress(model, recipe, samples)
    start = time.perf_counter()
    savers = {"gptq": save_gptq_checkpoint, "compressed-tensors": save_compressed_tensors_checkpoint}
    save = savers.get(fmt, save_checkpoint)
    out = save(ckpt.with_recipe(report.recipe), args.out)
    print(
        format_summary(
            report, args.model, args.out, fmt, bytes_before, directory_bytes(out), time.perf_counter() - start
        )
    )
    return 0


def model_bytes(model: torch.nn.Module, float_dtype: torch.dtype) -> int:
    """Bytes of the model's tensors with float parameters counted in `float_dtype` (the tied head once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers(recurse=True)):
        if t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        size = (
            torch.empty(0, dtype=float_dtype).element_size()
            if t.is_floating_point() and t.element_size() > 1
            else t.element_size()
        )
        total += t.numel() * size
    return total


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def format_summary(
    report: CompressionReport, model: str, out: str, fmt: str, bytes_before: int, bytes_after: int, save_s: float
) -> str:
    lines = [
        f"{model} -> {out} ({fmt} format): {' + '.join(report.methods)}",
        f"weights: {bytes_before / 2**20:.1f} MiB (bfloat16) -> {bytes_after / 2**20:.1f} MiB on disk "
        f"({bytes_before / max(bytes_after, 1):.2f}x smaller); compressed in {report.seconds:.1f} s, "
        f"saved in {save_s:.1f} s",
    ]
    for method, details in report.details.items():
        lines.append(f"{method}: " + ", ".join(f"{k} {v:.2%}" for k, v in details.items()))
    if not report.linears:
        return "\n".join(lines)
    by_kind: dict[str, list] = {}
    final = {r.name: r for r in report.linears}.values()  # each linear as the recipe's last step left it
    for r in final:
        by_kind.setdefault(r.name.rsplit(".", 1)[-1], []).append(r)
    sparse = any(r.sparsity > 0.01 for r in report.linears)  # a pruning step ran (natural zeros are rarer)
    lines.append(
        f"{'linear':<12} {'count':>5} {'format':<26} {'weight SQNR dB':>14} {'output rel. error (mean / max)':>30}"
        + (f" {'zeros':>7}" if sparse else "")
    )
    for kind, rs in by_kind.items():
        errs = [r.rel_error for r in rs if r.rel_error is not None]
        err = f"{statistics.mean(errs):.2e} / {max(errs):.2e}" if errs else "n/a (no calibration data)"
        lines.append(
            f"{kind:<12} {len(rs):>5} {rs[0].format:<26} "
            f"{statistics.mean(r.weight_sqnr_db for r in rs):>14.1f} {err:>30}"
            + (f" {statistics.mean(r.sparsity for r in rs):>7.1%}" if sparse else "")
        )
    worst = max((r for r in final if r.rel_error is not None), key=lambda r: r.rel_error, default=None)
    if worst is not None:
        lines.append(f"largest output error: {worst.name} ({worst.rel_error:.2e})")
    return "\n".join(lines)
