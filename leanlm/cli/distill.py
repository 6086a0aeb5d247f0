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
import time
from pathlib import Path

from leanlm.cli.train import STATE_FILE, add_run_args, format_result


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


def build_student(teacher, student: str | None, layers: list[int] | None, depth: int | None, device, qat=False):
    """The student Checkpoint the flags name from the `teacher` Checkpoint (see the module's docstring); with qat, a
    quantized checkpoint with its layers swapped for trainable fake-quantized stand-ins."""
    from leanlm.train.model import load_trainable
    from leanlm.train.qat import attach_fake_quant
    from leanlm.train.student import spread_layers, student_of

    if qat and student is None:
        raise ValueError("--qat trains a quantized student: pass it with --student DIR (leanlm quantize's output)")
    if student is not None:
        ckpt = load_trainable(student, device, keep_quantized=qat)
        if qat:
            attach_fake_quant(ckpt.model)
        if ckpt.config.vocab_size != teacher.config.vocab_size:
            raise ValueError(
                f"the student's vocabulary has {ckpt.config.vocab_size} tokens, the teacher's "
                f"{teacher.config.vocab_size}: distillation needs the same tokenizer"
            )
        return ckpt
    count = teacher.config.num_hidden_layers
    return student_of(teacher, layers or spread_layers(count, depth or max(count // 2, 1)))


def cmd_distill(args: argparse.Namespace) -> int:
    from leanlm.compress.calibration import read_calibration_text
    from leanlm.formats.native import save_checkpoint
    from leanlm.train.data import TokenWindows
    from leanlm.train.distill import DistillConfig, DistillObjective, prepare_teacher
    from leanlm.train.model import load_trainable
    from leanlm.train.qat import detach_fake_quant
    from leanlm.train.trainer import TrainConfig, Trainer

    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    distill = DistillConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)})
    layers = parse_layers(args.keep_layers)
    if args.data is not None and not Path(args.data).is_file():
        raise ValueError(f"training text {args.data} does not exist; pass a text file (or a MediaWiki .bz2 dump)")
    teacher_ckpt = load_trainable(args.teacher, args.device)
    teacher, tokenizer = teacher_ckpt.model, teacher_ckpt.tokenizer
    student_ckpt = build_student(teacher_ckpt, args.student, layers, args.student_layers, args.device, args.qat)
    del teacher_ckpt  # the teacher's weights go with `del teacher` below
    student = student_ckpt.model
    ids = tokenizer.encode(read_calibration_text(args.data), add_special_tokens=False)
    data = TokenWindows.from_ids(ids, config.seq_len, args.held_out)
    out = Path(args.out)
    if distill.cosine_weight > 0 and student.config.hidden_size != teacher.config.hidden_size:
        raise ValueError(
            f"--cosine-weight compares hidden states of one width: the teacher's are {teacher.config.hidden_size} "
            f"wide, the student's {student.config.hidden_size}; drop it for this student"
        )
    objective = None  # no teacher term: hard labels only, the control a distilled student is measured against
    if distill.needs_teacher:
        began = time.perf_counter()
        cache = prepare_teacher(
            teacher, args.teacher, data, config, distill, args.teacher_cache or out / "teacher_cache"
        )
        print(f"teacher cache {cache.directory} ready in {time.perf_counter() - began:.0f} s")
        objective = DistillObjective(distill, cache)
    del teacher
    state = out / STATE_FILE
    if state.is_file():
        print(f"resuming from {state}")
    trainer = Trainer(student, data, config, None, state, objective=objective)
    before = trainer.held_out_loss() if not state.is_file() else None
    result = trainer.run()
    if args.qat:
        detach_fake_quant(student)
    start = time.perf_counter()
    trained = student_ckpt.with_recipe([trainer.recipe_step()])
    save_checkpoint(dataclasses.replace(trained, tokenizer=tokenizer), out)  # the teacher's: the data's tokenizer
    if not args.keep_state:
        state.unlink(missing_ok=True)
    kind = "quantization-aware distillation" if args.qat else "distillation"
    recipe = f"{kind} ({student.config.num_hidden_layers} layers, {describe(distill)})"
    print(format_result(result, args.teacher, out, recipe, before, time.perf_counter() - start))
    return 0


def describe(config) -> str:
    if not config.needs_teacher:
        return "hard labels only"
    parts = []
    if config.kd_weight > 0:
        parts.append(
            f"{config.divergence} KL on the top {config.top_k} at T={config.temperature:g}, weight {config.kd_weight:g}"
        )
    if config.cosine_weight > 0:
        parts.append(f"hidden-state cosine, weight {config.cosine_weight:g}")
    return "; ".join(parts)
