"""run(TrainJob) and run_distill(DistillJob): the order a training run goes in, in one place.

train: load -> GQA conversion -> sparse upcycling -> RTN -> fake-quant stand-ins -> train (resumable) -> detach ->
TEAL threshold calibration or 2:4 packing -> save. A resumed run repeats the deterministic steps before the training
loop loads its state, so the state meets the same modules it was saved from.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from leanlm.train.job import DistillJob, TrainJob


@dataclass(frozen=True)
class TrainReport:
    """What a run did: the loop's result and the text a command prints for it."""

    result: object  # leanlm.train.trainer.TrainResult
    summary: str


def run(job: TrainJob, log: Callable[[str], None] = print) -> TrainReport:
    """Carry out one fine-tuning run (see the module docstring); `log` gets the lines a user sees on the way."""
    if not isinstance(job, TrainJob):
        hint = "a DistillJob runs with run_distill(job)" if isinstance(job, DistillJob) else "build TrainJob(out, ...)"
        raise TypeError(f"run takes a TrainJob, got {type(job).__name__}; {hint}")
    from leanlm.compress.calibration import calibration_samples, read_calibration_text
    from leanlm.compress.prune.pruner import pack_pruned
    from leanlm.compress.recipe import compress
    from leanlm.formats.native import save_checkpoint
    from leanlm.train.act_sparse import TEALTrainConfig
    from leanlm.train.data import TokenWindows
    from leanlm.train.model import load_trainable
    from leanlm.train.qat import attach_fake_quant, detach_fake_quant
    from leanlm.train.trainer import Trainer

    if job.lora is not None:
        return _train_lora(job, log)
    ckpt = load_trainable(job.model, job.device, keep_quantized=job.train_quantized)
    model, tokenizer = ckpt.model, ckpt.tokenizer
    if job.gqa is not None:  # deterministic, so a resumed run converts the same way before loading its state
        ckpt = ckpt.with_recipe(compress(model, [job.gqa], progress=False).recipe)
    if job.upcycle is not None:  # likewise (seeded routers): the MoE the state was saved from
        ckpt = ckpt.with_recipe(compress(model, [job.upcycle], progress=False).recipe)
    if job.qat is not None:  # likewise: RTN, then the trainable stand-ins the state was saved from
        ckpt = ckpt.with_recipe(compress(model, [job.qat], progress=False).recipe)
    if job.is_qat:
        attach_fake_quant(model)
    ids = tokenizer.encode(read_calibration_text(job.data), add_special_tokens=False)
    data = TokenWindows.from_ids(ids, job.train.seq_len, job.held_out)
    state = job.state_path
    resuming = state.is_file()
    if resuming:
        log(f"resuming from {state}")
    if job.exits is not None:
        return _train_exits(job, ckpt, data, resuming)
    sparsity = job.sparsity
    trainer = Trainer(model, data, job.train, sparsity, state)
    before = trainer.held_out_loss() if trainer.result.steps == 0 and not resuming else None
    result = trainer.run()
    ckpt = ckpt.with_recipe([trainer.recipe_step()])
    if job.is_qat:
        detach_fake_quant(model)
    # Trained weights become runtime modules: TEAL through its inference method (decode's fixed thresholds,
    # calibrated on the trained weights); a sparsity pattern by the packing rule its pruners' finalize follows.
    if isinstance(sparsity, TEALTrainConfig):
        calibration = calibration_samples(ids, 64, 256, seed=0)
        ckpt = ckpt.with_recipe(compress(model, [sparsity.runtime_config()], calibration, progress=False).recipe)
    elif sparsity is not None:
        pack_pruned(model, sparsity, [])
    start = time.perf_counter()
    save_checkpoint(ckpt, job.out, overwrite=True, keep_files=job.own_files)  # `out` was checked by the job
    if not job.keep_state:
        state.unlink(missing_ok=True)
    summary = format_result(result, job.model, job.out, _describe(job), before, time.perf_counter() - start)
    return TrainReport(result, summary)


def _describe(job: TrainJob) -> str:
    """What the run learned, in the summary's words."""
    sparsity = job.sparsity
    recipe = "fine-tuning" if sparsity is None else f"{sparsity.name} ({sparsity.sparsity_label})"
    if job.qat is not None:
        qat = job.qat
        recipe = f"quantization-aware training (W{qat.bits}" + (f" g{qat.group_size})" if qat.group_size else ")")
    if job.train_quantized:
        recipe = "quantization-aware training of the checkpoint's quantized layers"
    if job.gqa is not None:
        recipe += f", {job.gqa.num_key_value_heads} K/V heads ({job.gqa.init} init)"
    if (up := job.upcycle) is not None:
        kind = f"PR-MoE ({up.residual_init} init)" if up.residual else "sparse upcycling"
        where = "every layer" if up.layers is None else f"layers {','.join(map(str, up.layers))}"
        recipe += f", {kind}: {up.num_experts} experts top-{up.experts_per_token} in {where}"
    return recipe


def _train_lora(job: TrainJob, log: Callable[[str], None]) -> TrainReport:
    """An adapter on the frozen model as stored (float, or quantized: QLoRA), written to `out` in PEFT's format."""
    from leanlm.compress.calibration import read_calibration_text
    from leanlm.formats.loader import load_checkpoint
    from leanlm.formats.peft import write_adapter
    from leanlm.train.data import TokenWindows
    from leanlm.train.lora import LoRAObjective, attach_lora, lora_weights
    from leanlm.train.trainer import Trainer

    config = job.lora
    # every layer as stored (GGUF codes too): the base is frozen, its quantized layers run their own kernels
    ckpt = load_checkpoint(job.model, "float32", job.device, dequantize_gguf=False)
    model = ckpt.model
    attach_lora(model, config)  # seeded: a resumed run attaches the same pairs before loading its state
    ids = ckpt.tokenizer.encode(read_calibration_text(job.data), add_special_tokens=False)
    data = TokenWindows.from_ids(ids, job.train.seq_len, job.held_out)
    resuming = job.state_path.is_file()
    if resuming:
        log(f"resuming from {job.state_path}")
    trainer = Trainer(model, data, job.train, None, job.state_path, objective=LoRAObjective(config))
    before = trainer.held_out_loss() if not resuming else None
    result = trainer.run()
    start = time.perf_counter()
    write_adapter(job.out, lora_weights(model), config.r, config.alpha, job.model, config.use_rslora)
    if not job.keep_state:
        job.state_path.unlink(missing_ok=True)
    quantized = sorted({getattr(m, "format", "") for m in model.modules() if hasattr(m, "dequantized_weight")} - {""})
    base = f"on a frozen quantized base ({', '.join(quantized)}: QLoRA)" if quantized else "on the frozen float base"
    recipe = f"LoRA r={config.r} alpha={config.alpha:g} on {','.join(config.targets)} {base}"
    summary = format_result(result, job.model, job.out, recipe, before, time.perf_counter() - start)
    summary = summary.replace(
        f"evaluate with: leanlm eval ppl --model {job.out}",
        f"generate with: leanlm generate --model {job.model} --lora {job.out} PROMPT",
    )
    return TrainReport(result, summary)


def _train_exits(job: TrainJob, ckpt, data, resuming: bool) -> TrainReport:
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

    exits, config, model = job.exits, job.train, ckpt.model
    attach_exits(model, exits)
    trainer = Trainer(model, data, config, None, job.state_path, objective=ExitObjective(exits))
    before = None if resuming else exit_statistics(model, data.held_out, config.batch_size, config.dtype)
    result = trainer.run()
    after = exit_statistics(model, data.held_out, config.batch_size, config.dtype)
    save_checkpoint(ckpt.with_recipe([trainer.recipe_step()]), job.out, overwrite=True, keep_files=job.own_files)
    if not job.keep_state:
        job.state_path.unlink(missing_ok=True)
    resumed = f", resumed at step {result.resumed_from}" if result.resumed_from else ""
    lines = [
        f"{job.model} -> {job.out}: exits after layers {', '.join(map(str, exits.layers))}, {result.steps} steps, "
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
    lines.append(f"draft with them: leanlm generate --model {job.out} --speculative self:{exits.layers[-1]}")
    return TrainReport(result, "\n".join(lines))


def run_distill(job: DistillJob, log: Callable[[str], None] = print) -> TrainReport:
    """Carry out one distillation run: teacher, student, the teacher's top-k cache, the loop, save."""
    if not isinstance(job, DistillJob):
        hint = "a TrainJob runs with run(job)" if isinstance(job, TrainJob) else "build DistillJob(out, ...)"
        raise TypeError(f"run_distill takes a DistillJob, got {type(job).__name__}; {hint}")
    from leanlm.compress.calibration import read_calibration_text
    from leanlm.formats.native import save_checkpoint
    from leanlm.train.data import TokenWindows
    from leanlm.train.distill import DistillObjective, prepare_teacher
    from leanlm.train.model import load_trainable
    from leanlm.train.qat import detach_fake_quant
    from leanlm.train.trainer import Trainer

    config, distill = job.train, job.distill
    teacher_ckpt = load_trainable(job.teacher, job.device)
    teacher, tokenizer = teacher_ckpt.model, teacher_ckpt.tokenizer
    student_ckpt = build_student(teacher_ckpt, job)
    del teacher_ckpt  # the teacher's weights go with `del teacher` below
    student = student_ckpt.model
    ids = tokenizer.encode(read_calibration_text(job.data), add_special_tokens=False)
    data = TokenWindows.from_ids(ids, config.seq_len, job.held_out)
    if distill.cosine_weight > 0 and student.config.hidden_size != teacher.config.hidden_size:
        raise ValueError(
            f"--cosine-weight compares hidden states of one width: the teacher's are {teacher.config.hidden_size} "
            f"wide, the student's {student.config.hidden_size}; drop it for this student"
        )
    objective = None  # no teacher term: hard labels only, the control a distilled student is measured against
    if distill.needs_teacher:
        began = time.perf_counter()
        cache = prepare_teacher(teacher, job.teacher, data, config, distill, job.cache_dir)
        log(f"teacher cache {cache.directory} ready in {time.perf_counter() - began:.0f} s")
        objective = DistillObjective(distill, cache)
    del teacher
    state = job.state_path
    resuming = state.is_file()
    if resuming:
        log(f"resuming from {state}")
    trainer = Trainer(student, data, config, None, state, objective=objective)
    before = trainer.held_out_loss() if not resuming else None
    result = trainer.run()
    if job.qat:
        detach_fake_quant(student)
    start = time.perf_counter()
    trained = student_ckpt.with_recipe([trainer.recipe_step()])
    # the teacher's tokenizer: the data's; `out` was checked by the job
    save_checkpoint(
        dataclasses.replace(trained, tokenizer=tokenizer), job.out, overwrite=True, keep_files=job.own_files
    )
    if not job.keep_state:
        state.unlink(missing_ok=True)
    kind = "quantization-aware distillation" if job.qat else "distillation"
    recipe = f"{kind} ({student.config.num_hidden_layers} layers, {describe_distill(distill)})"
    return TrainReport(result, format_result(result, job.teacher, job.out, recipe, before, time.perf_counter() - start))


def build_student(teacher, job: DistillJob):
    """The student Checkpoint the job names from the `teacher` Checkpoint; with qat, a quantized checkpoint with
    its layers swapped for trainable fake-quantized stand-ins."""
    from leanlm.train.model import load_trainable
    from leanlm.train.qat import attach_fake_quant
    from leanlm.train.student import spread_layers, student_of

    if job.student is not None:
        ckpt = load_trainable(job.student, job.device, keep_quantized=job.qat)
        if job.qat:
            attach_fake_quant(ckpt.model)
        if ckpt.config.vocab_size != teacher.config.vocab_size:
            raise ValueError(
                f"the student's vocabulary has {ckpt.config.vocab_size} tokens, the teacher's "
                f"{teacher.config.vocab_size}: distillation needs the same tokenizer"
            )
        return ckpt
    count = teacher.config.num_hidden_layers
    layers = list(job.keep_layers) if job.keep_layers else None
    return student_of(teacher, layers or spread_layers(count, job.num_student_layers or max(count // 2, 1)))


def describe_distill(config) -> str:
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


def format_result(result, model: str, out, recipe: str, held_out_before: float | None, save_s: float) -> str:
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
    if result.expert_load:
        from leanlm.train.balance import describe_load, layer_loads

        aux = f"balancing loss {result.balance_losses[0]:.3f} -> {result.balance_losses[-1]:.3f} (1.0 = uniform); "
        lines.append(aux + describe_load(layer_loads(result.expert_load)))
    lines.append(f"saved in {save_s:.1f} s; evaluate with: leanlm eval ppl --model {out}")
    return "\n".join(lines)
