"""`leanlm distill`: train a student on a teacher's next-token distributions (cached top-k) and the hard labels,
to a token budget, resumably, and save it as a checkpoint the engine loads.

    leanlm distill --teacher smollm2-135m-instruct --student-layers 15 --tokens 600000 --out smol-15
    leanlm distill --teacher smollm2-135m-instruct --student-layers 15 --kd-weight 0 --out smol-15-ce  # control

The student is a checkpoint (--student) or, by default, the teacher with half its layers (one out of two, as
DistilBERT initialises). The teacher's top-k distribution over every window the run reads is computed once into
--teacher-cache (default OUT/teacher_cache), which later runs on the same text reuse. Run the same command again
after an interruption and it resumes from OUT/train_state.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from leanlm.cli.train import add_run_args, train_config


def parse_layers(spec: str | None) -> list[int] | None:
    """'0,2,4' -> [0, 2, 4]."""
    if spec is None:
        return None
    try:
        return [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"--keep-layers takes comma-separated layer indices, e.g. 0,2,4; got {spec!r}") from None


def add_parser(sub) -> None:
    from leanlm.cli.common import add_dataclass_args
    from leanlm.loading.registry import DEFAULT_MODEL
    from leanlm.train.distill import DistillConfig

    p = sub.add_parser("distill", help="train a smaller student on a teacher's distributions (knowledge distillation)")
    p.add_argument("--teacher", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    student = p.add_mutually_exclusive_group()
    student.add_argument("--student", default=None, help="a student checkpoint with the teacher's vocabulary")
    student.add_argument(
        "--student-layers",
        type=int,
        default=None,
        help="the teacher with this many layers, evenly spaced (default half)",
    )
    student.add_argument("--keep-layers", default=None, help="the teacher with these layers, e.g. 0,2,4,...")
    p.add_argument(
        "--qat",
        action="store_true",
        help="with --student: a quantized checkpoint whose int8 / 2-4 bit layers train through fake quantization "
        "on the teacher's distribution (LLM-QAT)",
    )
    add_dataclass_args(p, DistillConfig)
    p.add_argument("--teacher-cache", default=None, help="where the teacher's top-k lives (default OUT/teacher_cache)")
    add_run_args(p)
    p.set_defaults(func=cmd_distill)


def cmd_distill(args: argparse.Namespace) -> int:
    from leanlm.train import DistillJob, run_distill
    from leanlm.train.distill import DistillConfig

    layers = parse_layers(args.keep_layers)
    job = DistillJob(
        out=Path(args.out),
        teacher=args.teacher,
        student=args.student,
        keep_layers=None if layers is None else tuple(layers),
        num_student_layers=args.student_layers,
        qat=args.qat,
        distill=DistillConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)}),
        train=train_config(args),
        teacher_cache=None if args.teacher_cache is None else Path(args.teacher_cache),
        data=args.data,
        held_out=args.held_out,
        keep_state=args.keep_state,
        device=args.device,
        overwrite=args.overwrite,
    )
    print(run_distill(job).summary)
    return 0
