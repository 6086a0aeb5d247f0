"""`leanlm moefy`: MoEfication (docs/moefication.md): split every layer's FFN into experts by clustering its neurons,
fit a router on calibration text, save the mixture-of-experts checkpoint the engine loads (`LLM(path)`)."""

from __future__ import annotations

import argparse

from leanlm.compress.transform.expert_split import SPLITS
from leanlm.compress.transform.moefy import ROUTERS


def add_parser(sub) -> None:
    from leanlm.cli.quantize import add_calibration_args, add_output_args
    from leanlm.loading.registry import DEFAULT_MODEL

    p = sub.add_parser("moefy", help="turn a dense model's FFNs into experts with a router (MoEfication) and save it")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    p.add_argument("--experts", type=int, default=16, help="experts per layer (must divide intermediate_size)")
    p.add_argument("--top-k", type=int, default=4, help="experts run per token (top-k = experts: the dense model)")
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="coactivation",
        help="cluster neurons by their activations on the calibration text, or by their gate_proj weights",
    )
    p.add_argument(
        "--router",
        choices=ROUTERS,
        default="ridge",
        help="ridge: fitted to predict each expert's activation norm; centroid: each expert's mean gate row",
    )
    p.add_argument(
        "--shared-neurons",
        type=int,
        default=0,
        help="keep this many of the busiest neurons in an always-on shared expert; the rest are split and routed",
    )
    add_calibration_args(p, "the coactivation split and the ridge router")
    add_output_args(p)
    p.set_defaults(func=cmd_moefy)


def cmd_moefy(args: argparse.Namespace) -> int:
    from leanlm.cli.quantize import run_job
    from leanlm.compress.transform.moefy import MoefyConfig

    config = MoefyConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        split=args.split,
        router=args.router,
        shared_neurons=args.shared_neurons,
    )
    return run_job(args, [config], "leanlm")
