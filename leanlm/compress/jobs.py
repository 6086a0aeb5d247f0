"""CompressJob and run_compress: load a model in float32, calibrate (when the recipe needs data or a text is
given), compress, save in a checkpoint format and summarize: what `leanlm quantize` and `leanlm prune` run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm.compress.base import CompressionReport, MethodConfig, build_method
from leanlm.compress.prune.magnitude import MagnitudeConfig
from leanlm.compress.prune.permute import PermuteConfig
from leanlm.compress.prune.sparsegpt import SparseGPTConfig
from leanlm.compress.prune.wanda import WandaConfig
from leanlm.compress.quality import QualityCheck, held_out_windows, perplexity_of
from leanlm.compress.quantize.gptq import GPTQConfig
from leanlm.compress.quantize.rtn import RTNConfig
from leanlm.loading.registry import DEFAULT_MODEL

FORMATS = ("leanlm", "gptq", "compressed-tensors")  # checkpoint layouts (leanlm.compress.*_format)


@dataclass(frozen=True)
class CompressJob:
    """One compression run: a model, the recipe, the calibration windows and where the result goes."""

    out: Path  # output directory
    recipe: tuple[MethodConfig, ...]  # run in order by compress() (named_recipes builds the CLI's)
    model: str = DEFAULT_MODEL  # bundled model name, GGUF file or HF directory
    format: str = "leanlm"  # one of FORMATS
    calib: str | None = None  # calibration text (None: gensim's Wikipedia articles)
    num_samples: int = 64  # calibration windows
    seq_len: int = 256  # tokens per calibration window
    seed: int = 0  # seeds the windows' positions in the text
    device: str | None = None  # cpu | cuda (None: cuda when present)
    overwrite: bool = False  # replace a non-empty `out` (never the model or calibration file it reads)

    def __post_init__(self) -> None:
        from leanlm.formats.output_dir import check_output_dir

        object.__setattr__(self, "out", Path(self.out))
        if isinstance(self.recipe, MethodConfig):
            raise TypeError(f"a CompressJob's recipe is a sequence of method configs: recipe=({self.recipe!r},)")
        object.__setattr__(self, "recipe", tuple(self.recipe))
        if not self.recipe:
            raise ValueError("an empty recipe compresses nothing: give at least one method config")
        wrong = [type(cfg).__name__ for cfg in self.recipe if not isinstance(cfg, MethodConfig)]
        if wrong:
            raise TypeError(
                f"a CompressJob's recipe holds method configs (RTNConfig(bits=8), GPTQConfig(...), ...), got {wrong}"
            )
        # before the (long) run, not at its end: the model and data it reads, and another model's directory
        check_output_dir(self.out, [self.model, self.calib], overwrite=self.overwrite)
        if self.format not in FORMATS:
            raise ValueError(f"unknown checkpoint format {self.format!r}; use one of {', '.join(FORMATS)}")
        if self.calib is not None and not Path(self.calib).is_file():
            raise ValueError(
                f"calibration file {self.calib} does not exist; pass a text file (or a MediaWiki .bz2 dump)"
            )
        if self.num_samples < 1 or self.seq_len < 2:
            raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {self.num_samples} and {self.seq_len}")
        if self.format == "gptq":  # symmetric 4-bit weight-only codes: refuse anything else before the (long) run
            last = self.recipe[-1]
            if not isinstance(last, (RTNConfig, GPTQConfig)) or last.bits != 4 or last.act_bits is not None:
                raise ValueError("--format gptq writes 4-bit weight-only layers: use --method gptq|rtn|awq --bits 4")
            if not last.symmetric:
                raise ValueError("--format gptq needs symmetric weights (the layout stores zero - 1): add --symmetric")
        if self.format == "compressed-tensors" and not all(map(_is_pruning_only, self.recipe)):
            raise ValueError("--format compressed-tensors writes pruned float weights: drop --then-quantize/--joint")

    @property
    def needs_calibration(self) -> bool:
        return any(build_method(cfg).needs for cfg in self.recipe)


def _is_pruning_only(config: MethodConfig) -> bool:
    """Leaves float weights with zeros (what the compressed-tensors sparse layouts hold)."""
    if isinstance(config, SparseGPTConfig):
        return config.bits is None
    return isinstance(config, (MagnitudeConfig, WandaConfig, PermuteConfig))


@dataclass(frozen=True)
class CompressResult:
    report: CompressionReport  # per method and per linear
    out: Path  # the checkpoint directory
    summary: str  # what the commands print
    quality: QualityCheck | None  # held-out perplexity before and after (None: it could not run, says summary)


def run_compress(job: CompressJob) -> CompressResult:
    """Load, calibrate, compress, save and summarize (see the module docstring)."""
    from leanlm.compress.calibration import calibration_samples, read_calibration_text
    from leanlm.compress.recipe import compress
    from leanlm.formats import (
        load_checkpoint,
        save_checkpoint,
        save_compressed_tensors_checkpoint,
        save_gptq_checkpoint,
    )

    ckpt = load_checkpoint(job.model, "float32", job.device or None)
    model = ckpt.model
    samples = None
    if job.needs_calibration or job.calib:
        ids = ckpt.tokenizer.encode(read_calibration_text(job.calib), add_special_tokens=False)
        samples = calibration_samples(ids, job.num_samples, job.seq_len, job.seed)
    bytes_before = model_bytes(model, torch.bfloat16)
    try:
        windows = held_out_windows(ckpt.tokenizer, model.config.vocab_size, next(model.parameters()).device)
    except ValueError as exc:  # the source checkpoint's own fault: compress it, and say why it was not checked
        windows, skipped = None, f"quality check skipped: {exc}"
    ppl_before = None if windows is None else perplexity_of(model, windows)
    report = compress(model, list(job.recipe), samples)
    quality = (
        None if windows is None else QualityCheck(ppl_before, perplexity_of(model, windows), windows[:, 1:].numel())
    )
    start = time.perf_counter()
    savers = {"gptq": save_gptq_checkpoint, "compressed-tensors": save_compressed_tensors_checkpoint}
    out = savers.get(job.format, save_checkpoint)(ckpt.with_recipe(report.recipe), job.out, overwrite=job.overwrite)
    save_s = time.perf_counter() - start
    summary = format_summary(report, job.model, str(job.out), job.format, bytes_before, directory_bytes(out), save_s)
    summary += "\n" + (skipped if quality is None else quality.describe())
    return CompressResult(report, Path(out), summary, quality)


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
