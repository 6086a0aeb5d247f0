"""`leanlm estimate`: params, memory, KV cache, FLOPs and roofline times of a model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from leanlm.cli.common import (
    add_dataclass_args,
)


def cmd_estimate(args: argparse.Namespace) -> int:
    from leanlm.analysis.estimate_report import (
        EstimateSettings,
        build_report,
        format_report,
        plot_roofline,
    )
    from leanlm.analysis.hardware_profiles import HARDWARE, measure_hardware
    from leanlm.analysis.model_shape import load_shape

    settings = EstimateSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EstimateSettings)})
    if args.measure and args.hardware not in (None, "this"):
        raise ValueError(f"--measure measures this machine; drop --hardware {args.hardware} or --measure")
    shape, source = load_shape(args.model)
    hardware = measure_hardware() if args.measure or args.hardware == "this" else HARDWARE[args.hardware or "h100"]
    report = build_report(shape, source, hardware, settings)
    print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
    if args.plot:
        plot_roofline(report, args.plot)
        print(f"roofline plot: {args.plot}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    from leanlm.analysis.estimate_report import EstimateSettings
    from leanlm.analysis.model_shape import PRESETS

    est = sub.add_parser("estimate", help="what a model costs: params, memory, KV cache, FLOPs, roofline times")
    est.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help=f"bundled model name, GGUF file, HF directory or a preset: {', '.join(PRESETS)}",
    )
    est.add_argument(
        "--hardware",
        choices=["a100", "h100", "h200", "this"],
        default=None,
        help="hardware profile (default h100); `this` measures this machine",
    )
    est.add_argument("--measure", action="store_true", help="measure this machine's bandwidth and matmul FLOP/s")
    est.add_argument("--json", action="store_true", help="print the report as JSON")
    est.add_argument("--plot", default=None, metavar="OUT.png", help="write a roofline plot")
    add_dataclass_args(est, EstimateSettings)
    est.set_defaults(func=cmd_estimate)
