"""`leanlm train`: fine-tune a model (dense, or with a training-time sparsity method) on a text to a token
budget, resumably, and save it as a checkpoint the engine loads (2:4 results packed for the sparse kernels).

    leanlm prune --method sparsegpt --pattern 2:4 --out smol-24
    leanlm train --model smol-24 --recipe sr-ste --pattern 2:4 --tokens 600000 --out smol-24-srste
    leanlm train --recipe teal --sparsity 0.4 --tokens 250000 --out smol-teal40   # activation sparsity
    leanlm train --exits 8,16,24 --lr 1e-3 --tokens 100000 --out smol-exits   # then --speculative self:24

Run the same command again after an interruption and it resumes from OUT/train_state.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

RECIPES = ("finetune", "masked", "gmp", "rewind", "sr-ste", "top-kast", "teal")
STATE_FILE = "train_state.pt"


def build_sparsity(
    recipe: str,
    sparsity: float | None = None,
    pattern: str | None = None,
    decay: float | None = None,
    backward_sparsity: float | None = None,
    rounds: int | None = None,
):
    """The training-time sparsity config behind --recipe (None for plain fine-tuning); validates the flags."""
    from leanlm.train.recipes import TRAINING_CONFIGS

    extras = {"decay": decay, "backward_sparsity": backward_sparsity, "rounds": rounds}
    if recipe == "finetune":
        given = [k for k, v in {"sparsity": sparsity, "pattern": pattern, **extras}.items() if v is not None]
        if given:
            raise ValueError(f"--recipe finetune trains dense weights; {', '.join(given)} need a sparsity recipe")
        return None
    if recipe not in TRAINING_CONFIGS:
        raise ValueError(f"unknown recipe {recipe!r}; use one of {', '.join(RECIPES)}")
    cls = TRAINING_CONFIGS[recipe]
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in extras.items():
        if value is not None and key not in names:
            raise ValueError(f"--{key.replace('_', '-')} does not apply to --recipe {recipe}")
    options = {k: v for k, v in extras.items() if v is not None}
    return cls(sparsity=sparsity, pattern=pattern, **options)


def add_parser(sub) -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    p = sub.add_parser("train", help="fine-tune a model, dense or learning sparsity (GMP, SR-STE, Top-KAST, ...)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    p.add_argument("--recipe", choices=RECIPES, default="finetune", help="what the run learns (docs/sparsity.md)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--sparsity", type=float, default=None, help="fraction of weights to zero (default 0.5)")
    target.add_argument("--pattern", default=None, help="N:M sparsity, e.g. 2:4")
    p.add_argument("--decay", type=float, default=None, help="sr-ste: lambda on pruned weights; top-kast: L2")
    p.add_argument("--backward-sparsity", type=float, default=None, help="top-kast: sparsity of the backward set")
    p.add_argument("--rounds", type=int, default=None, help="rewind: prune-and-rewind rounds")
    p.add_argument(
        "--kv-heads", type=int, default=None, help="convert to this many K/V heads first (GQA / MQA uptraining)"
    )
    p.add_argument("--kv-init", default="mean", help="with --kv-heads: mean | first | random (default mean)")
    p.add_argument(
        "--qat-bits", type=int, default=None, help="quantization-aware training: RTN to these bits first (2-4, 8)"
    )
    p.add_argument("--qat-group-size", type=int, default=64, help="with --qat-bits: columns per scale; 0 = per channel")
    p.add_argument(
        "--qat",
        action="store_true",
        help="quantization-aware training of the checkpoint's own int8 / 2-4 bit layers (e.g. a GPTQ output made "
        "with --static-groups)",
    )
    p.add_argument(
        "--exits",
        default=None,
        help="train early-exit heads after these layer counts (e.g. 8,16,24) on the frozen model",
    )
    p.add_argument("--exit-adapter-rank", type=int, default=0, help="with --exits: 0 = norm only; r = + rank-r adapter")
    p.add_argument("--exit-temperature", type=float, default=1.0, help="with --exits: temperature of the KL")
    p.add_argument("--exit-ce-weight", type=float, default=0.0, help="with --exits: weight of next-token CE")
    add_run_args(p)
    p.set_defaults(func=cmd_train)


def add_run_args(p) -> None:
    """The flags every training command shares: the text, the run's settings, where it goes."""
    from leanlm.cli.common import add_dataclass_args
    from leanlm.train.trainer import TrainConfig

    p.add_argument("--data", default=None, help="training text (default: gensim's Wikipedia articles, not WikiText)")
    p.add_argument("--held-out", type=int, default=4, help="windows at the end of the text kept for held-out loss")
    add_dataclass_args(p, TrainConfig)
    p.add_argument("--out", required=True, help="output directory (the run's resumable state lives there too)")
    p.add_argument("--keep-state", action="store_true", help=f"keep OUT/{STATE_FILE} after the run completes")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")


def cmd_train(args: argparse.Namespace) -> int:
    from leanlm.compress.calibration import calibration_samples, read_calibration_text
    from leanlm.compress.prune.pruner import pack_semi_structured
    from leanlm.compress.quantize.rtn import RTNConfig
    from leanlm.compress.recipe import compress
    from leanlm.compress.transform.gqa import GQAConfig
    from leanlm.formats.native import save_checkpoint
    from leanlm.train.act_sparse import TEALTrainConfig
    from leanlm.train.data import TokenWindows
    from leanlm.train.model import load_trainable
    from leanlm.train.qat import attach_fake_quant, detach_fake_quant
    from leanlm.train.trainer import TrainConfig, Trainer

    sparsity = build_sparsity(
        args.recipe, args.sparsity, args.pattern, args.decay, args.backward_sparsity, args.rounds
    )  # validates before loading
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    gqa = None if args.kv_heads is None else GQAConfig(num_key_value_heads=args.kv_heads, init=args.kv_init)
    qat = None if args.qat_bits is None else RTNConfig(bits=args.qat_bits, group_size=args.qat_group_size or None)
    if args.qat and qat is not None:
        raise ValueError(
            "--qat trains the checkpoint's quantized layers, --qat-bits quantizes with RTN first: pick one"
        )
    if (qat is not None or args.qat) and sparsity is not None:
        raise ValueError(f"QAT trains a quantized model: it does not combine with --recipe {args.recipe}")
    if args.data is not None and not Path(args.data).is_file():
        raise ValueError(f"training text {args.data} does not exist; pass a text file (or a MediaWiki .bz2 dump)")
    exits = build_exits_config(args)
    if exits is not None and (sparsity is not None or qat is not None or args.qat or gqa is not None):
        raise ValueError("--exits trains heads on a frozen model: it does not combine with a recipe, QAT or GQA")
    ckpt = load_trainable(args.model, args.device, keep_quantized=args.qat)
    model, tokenizer = ckpt.model, ckpt.tokenizer
    if gqa is not None:  # deterministic, so a resumed run converts the same way before loading its state
        ckpt = ckpt.with_recipe(compress(model, [gqa], progress=False).recipe)
    if qat is not None:  # likewise: RTN, then the trainable stand-ins the state was saved from
        ckpt = ckpt.with_recipe(compress(model, [qat], progress=False).recipe)
    if qat is not None or args.qat:
        attach_fake_quant(model)
    ids = tokenizer.encode(read_calibration_text(args.data), add_special_tokens=False)
    data = TokenWindows.from_ids(ids, config.seq_len, args.held_out)
    out = Path(args.out)
    state = out / STATE_FILE
    if state.is_file():
        print(f"resuming from {state}")
    if exits is not None:
        return _train_exits(ckpt, data, config, exits, state, args)
    trainer = Trainer(model, data, config, sparsity, state)
    before = trainer.held_out_loss() if trainer.result.steps == 0 and not state.is_file() else None
    result = trainer.run()
    ckpt = ckpt.with_recipe([trainer.recipe_step()])
    if qat is not None or args.qat:
        detach_fake_quant(model)
    if isinstance(sparsity, TEALTrainConfig):  # decode's fixed thresholds, calibrated on the trained weights
        calibration = calibration_samples(ids, 64, 256, seed=0)
        ckpt = ckpt.with_recipe(compress(model, [sparsity.runtime_config()], calibration, progress=False).recipe)
    elif sparsity is not None and sparsity.pattern in ("2:4", None) and sparsity.pack:  # 2:4, or sparse enough
        pack_semi_structured(model, [])
    start = time.perf_counter()
    save_checkpoint(ckpt, out)
    if not args.keep_state:
        state.unlink(missing_ok=True)
    recipe = "fine-tuning" if sparsity is None else f"{sparsity.name} ({sparsity.sparsity_label})"
    if qat is not None:
        recipe = f"quantization-aware training (W{qat.bits}" + (f" g{qat.group_size})" if qat.group_size else ")")
    if args.qat:
        recipe = "quantization-aware training of the checkpoint's quantized layers"
    if gqa is not None:
        recipe += f", {gqa.num_key_value_heads} K/V heads ({gqa.init} init)"
    print(format_result(result, args.model, out, recipe, before, time.perf_counter() - start))
    return 0


def build_exits_config(args: argparse.Namespace):
    """The ExitHeadsConfig behind --exits (None without it); validates the flags."""
    from leanlm.train.exits import ExitHeadsConfig

    if args.exits is None:
        return None
    try:
        layers = tuple(int(k) for k in args.exits.split(","))
    except ValueError:
        raise ValueError(f"--exits takes layer counts separated by commas, e.g. 8,16,24; got {args.exits!r}") from None
    return ExitHeadsConfig(layers, args.exit_temperature, args.exit_ce_weight, args.exit_adapter_rank)


def _train_exits(ckpt, data, config, exits, state: Path, args: argparse.Namespace) -> int:
    """Exit heads on the frozen model: held-out KL and agreement with the final layer before and after, a 95%
    threshold per exit and confidence measure, and the model saved with its exits."""
    from leanlm.formats.native import save_checkpoint
    from leanlm.train.exits import (
        CONFIDENCE_MEASURES,
        ExitObjective,
        attach_exits,
        calibrate_threshold,
        exit_statistics,
    )
    from leanlm.train.trainer import Trainer

    model = ckpt.model
    attach_exits(model, exits)
    trainer = Trainer(model, data, config, None, state, objective=ExitObjective(exits))
    before = None if state.is_file() else exit_statistics(model, data.held_out, config.batch_size, config.dtype)
    result = trainer.run()
    after = exit_statistics(model, data.held_out, config.batch_size, config.dtype)
    save_checkpoint(ckpt.with_recipe([trainer.recipe_step()]), Path(args.out))
    if not args.keep_state:
        state.unlink(missing_ok=True)
    resumed = f", resumed at step {result.resumed_from}" if result.resumed_from else ""
    lines = [
        f"{args.model} -> {args.out}: exits after layers {', '.join(map(str, exits.layers))}, {result.steps} steps, "
        f"{result.tokens:,} tokens in {result.seconds:.0f} s ({result.tokens_per_second:.0f} tokens/s){resumed}",
        f"held-out ({data.held_out.numel():,} tokens), against the final layer:",
    ]
    for k, s in after.items():
        was = f"KL {before[k].mean_kl:.3f} -> " if before else "KL "
        agree = f"top-1 {before[k].agreement:.3f} -> " if before else "top-1 "
        lines.append(f"  exit {k}: {was}{s.mean_kl:.3f}, {agree}{s.agreement:.3f}")
    lines.append("thresholds for 95% agreement with the full model (share of tokens that would exit there):")
    for k, s in after.items():
        cells = []
        for measure in CONFIDENCE_MEASURES:
            c = calibrate_threshold(s, measure, 0.95)
            cells.append(
                f"{measure} " + ("none" if c.threshold is None else f">= {c.threshold:.3f}: {c.exit_fraction:.1%}")
            )
        lines.append(f"  exit {k}: " + "; ".join(cells))
    lines.append(f"draft with them: leanlm generate --model {args.out} --speculative self:{exits.layers[-1]}")
    print("\n".join(lines))
    return 0


def format_result(result, model: str, out: Path, recipe: str, held_out_before: float | None, save_s: float) -> str:
    """What a training command prints when it is done; `recipe` names what the run learned."""
    resumed = f", resumed at step {result.resumed_from}" if result.resumed_from else ""
    lines = [
        f"{model} -> {out}: {recipe}, {result.steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s "
        f"({result.tokens_per_second:.0f} tokens/s){resumed}"
    ]
    if result.held_out:
        first = f"{held_out_before:.4f} -> " if held_out_before is not None else ""
        lines.append(f"held-out loss: {first}{result.held_out[-1][1]:.4f} (step {result.held_out[-1][0]})")
    if result.sparsity:
        lines += [f"{key} of the trained linears: {value:.1%}" for key, value in result.sparsity.items()]
    lines.append(f"saved in {save_s:.1f} s; evaluate with: leanlm eval ppl --model {out}")
    return "\n".join(lines)
