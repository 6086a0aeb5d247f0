"""`leanlm train`: fine-tune a model (dense, or with a training-time sparsity method) on a text to a token
budget, resumably, and save it as a checkpoint the engine loads (2:4 results packed for the sparse kernels).

    leanlm prune --method sparsegpt --pattern 2:4 --out smol-24
    leanlm train --model smol-24 --recipe sr-ste --pattern 2:4 --tokens 600000 --out smol-24-srste
    leanlm train --recipe teal --sparsity 0.4 --tokens 250000 --out smol-teal40   # activation sparsity
    leanlm train --exits 8,16,24 --lr 1e-3 --tokens 100000 --out smol-exits   # then --speculative self:24
    leanlm train --upcycle-experts 8 --upcycle-top-k 2 --tokens 200000 --out smol-moe   # sparse upcycling
    leanlm train --model smol-int4 --lora 16 --lr 2e-4 --tokens 200000 --out smol-qlora   # QLoRA adapter (PEFT)

Run the same command again after an interruption and it resumes from OUT/train_state.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from leanlm.train.job import RECIPES, STATE_FILE


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
    add_upcycle_args(p)
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
    p.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="R",
        help="train a rank-R LoRA adapter on the frozen model instead (a quantized --model: QLoRA) and write it in "
        "PEFT's format to --out (use a higher --lr, e.g. 2e-4)",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="with --lora: PEFT's lora_alpha (default 2 R)")
    p.add_argument(
        "--lora-targets",
        default=None,
        help="with --lora: linears to adapt, comma-separated (default q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
        "down_proj)",
    )
    p.add_argument("--lora-rslora", action="store_true", help="with --lora: scale alpha / sqrt(R) (rsLoRA)")
    add_run_args(p)
    p.set_defaults(func=cmd_train)


def add_upcycle_args(p) -> None:
    """Sparse upcycling (and PR-MoE) before training: docs/upcycling.md."""
    p.add_argument(
        "--upcycle-experts", type=int, default=None, help="make each dense MLP this many experts first (upcycling)"
    )
    p.add_argument("--upcycle-top-k", type=int, default=None, help="experts per token (default 2; 1 with --pr-moe)")
    p.add_argument("--pr-moe", action="store_true", help="keep the dense MLP as a shared expert (residual MoE)")
    p.add_argument("--pr-moe-init", default="zero", help="zero | half: how the routed experts start (docs)")
    p.add_argument("--upcycle-layers", default=None, help="layers to upcycle, e.g. 1,3,5 (default: every layer)")
    p.add_argument("--router-aux-loss-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--upcycle-save-as", default="auto", help="auto | mixtral | source (llama + leanlm_moe block)")


def build_upcycle_config(args: argparse.Namespace):
    """The UpcycleConfig behind --upcycle-experts (None without it); validates the flags."""
    from leanlm.compress.transform.upcycle import UpcycleConfig

    if args.upcycle_experts is None:
        if args.pr_moe or args.upcycle_top_k is not None or args.upcycle_layers is not None:
            raise ValueError("--pr-moe, --upcycle-top-k and --upcycle-layers need --upcycle-experts E")
        return None
    try:
        layers = None if args.upcycle_layers is None else tuple(int(i) for i in args.upcycle_layers.split(","))
    except ValueError:
        raise ValueError(f"--upcycle-layers takes layer indices like 1,3,5; got {args.upcycle_layers!r}") from None
    return UpcycleConfig(
        num_experts=args.upcycle_experts,
        top_k=args.upcycle_top_k,
        residual=args.pr_moe,
        residual_init=args.pr_moe_init,
        router_aux_loss_coef=args.router_aux_loss_coef,
        layers=layers,
        save_as=args.upcycle_save_as,
    )


def add_run_args(p) -> None:
    """The flags every training command shares: the text, the run's settings, where it goes."""
    from leanlm.cli.common import add_dataclass_args
    from leanlm.train.trainer import TrainConfig

    p.add_argument("--data", default=None, help="training text (default: gensim's Wikipedia articles, not WikiText)")
    p.add_argument("--held-out", type=int, default=4, help="windows at the end of the text kept for held-out loss")
    add_dataclass_args(p, TrainConfig)
    p.add_argument("--out", required=True, help="output directory (the run's resumable state lives there too)")
    p.add_argument("--keep-state", action="store_true", help=f"keep OUT/{STATE_FILE} after the run completes")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out that holds no run state (never the model or data the run reads); a --out "
        "with a run's state resumes that run without it",
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")


def cmd_train(args: argparse.Namespace) -> int:
    from leanlm.train import run

    job = build_train_job(args)  # checks every flag before anything loads
    print(run(job).summary)
    return 0


def build_train_job(args: argparse.Namespace):
    """The TrainJob the flags describe."""
    from leanlm.compress.quantize.rtn import RTNConfig
    from leanlm.compress.transform.gqa import GQAConfig
    from leanlm.train import TrainJob, build_sparsity

    sparsity = build_sparsity(args.recipe, args.sparsity, args.pattern, args.decay, args.backward_sparsity, args.rounds)
    return TrainJob(
        out=Path(args.out),
        model=args.model,
        train=train_config(args),
        sparsity=sparsity,
        gqa=None if args.kv_heads is None else GQAConfig(num_key_value_heads=args.kv_heads, init=args.kv_init),
        upcycle=build_upcycle_config(args),
        qat=None if args.qat_bits is None else RTNConfig(bits=args.qat_bits, group_size=args.qat_group_size or None),
        train_quantized=args.qat,
        exits=build_exits_config(args),
        lora=build_lora_config(args),
        data=args.data,
        held_out=args.held_out,
        keep_state=args.keep_state,
        device=args.device,
        overwrite=args.overwrite,
    )


def build_lora_config(args: argparse.Namespace):
    """The LoRATrainConfig behind --lora (None without it); validates the flags."""
    from leanlm.train.lora import LORA_TARGETS, LoRATrainConfig

    if args.lora is None:
        if args.lora_alpha is not None or args.lora_targets is not None or args.lora_rslora:
            raise ValueError("--lora-alpha, --lora-targets and --lora-rslora need --lora R")
        return None
    targets = LORA_TARGETS if args.lora_targets is None else tuple(t.strip() for t in args.lora_targets.split(","))
    return LoRATrainConfig(r=args.lora, alpha=args.lora_alpha, targets=targets, use_rslora=args.lora_rslora)


def train_config(args: argparse.Namespace):
    from leanlm.train.trainer import TrainConfig

    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


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
