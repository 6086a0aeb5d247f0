"""Knowledge distillation (Hinton et al. 2015; DistilBERT; MiniLLM's reverse KL): the student learns the
teacher's next-token distribution, read from a TeacherCache, mixed with the hard-label loss and, as DistilBERT
adds, the cosine distance between the two models' final hidden states:

    loss = kd_weight * T^2 * D(teacher_T, student_T) + (1 - kd_weight) * CE(student, next token)
           + cosine_weight * (1 - cos(student hidden, teacher hidden))

D is KL(teacher || student) (forward: the student covers every mode the teacher gives mass) or KL(student ||
teacher) (reverse: the student concentrates on the teacher's main modes), over the cached top-k tokens plus one
bin for the rest of the vocabulary, at temperature T; T^2 keeps the gradient's scale independent of T. The
hidden states are the final-normed ones the head reads, so the cosine term needs a student of the teacher's width
(DistilBERT keeps BERT's width and halves its depth). DistilBERT's weights 5 / 2 / 1 (soft / hard / cosine) are
kd_weight 5/7 and cosine_weight 1/7 here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.model.forward import hidden_states
from leanlm.train.data import TokenWindows
from leanlm.train.teacher_cache import CHUNK, TeacherCache, TeacherTargets, tail_logprob
from leanlm.train.trainer import DTYPES, TrainConfig, _opt

DIVERGENCES = ("forward", "reverse")


@dataclass(frozen=True)
class DistillConfig:
    top_k: int = _opt(32, "teacher tokens cached per position (the rest of its mass is one bin)")
    temperature: float = _opt(1.0, "softens teacher and student alike; the KD term is scaled by its square")
    kd_weight: float = _opt(1.0, "weight of the teacher term; 1 - it weighs the hard-label loss (0 = no teacher)")
    divergence: str = _opt(
        "forward", "forward: KL(teacher || student); reverse: KL(student || teacher)", choices=DIVERGENCES
    )
    cosine_weight: float = _opt(
        0.0, "weight of DistilBERT's 1 - cos(student, teacher) on the final hidden states (same width needed)"
    )

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.kd_weight <= 1:
            raise ValueError(f"kd_weight must be in [0, 1], got {self.kd_weight}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {self.divergence!r}")
        if not self.cosine_weight >= 0:
            raise ValueError(f"cosine_weight must be >= 0, got {self.cosine_weight}")

    @property
    def needs_teacher(self) -> bool:
        """False for the hard-label control (kd_weight 0, no cosine term), which trains without a teacher."""
        return self.kd_weight > 0 or self.cosine_weight > 0


def distillation_loss_sum(
    scores: torch.Tensor,
    targets: torch.Tensor,
    teacher: TeacherTargets,
    config: DistillConfig,
) -> torch.Tensor:
    """Summed loss of n positions: student scores [n, V], next tokens [n], the teacher's cached bins
    (indices, logprobs [n, k], tail [n])."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # bf16 under autocast
    total = scores.new_zeros(())
    if config.kd_weight > 0:
        soft = scores / config.temperature
        student = soft.gather(-1, teacher.indices) - torch.logsumexp(soft, dim=-1, keepdim=True)  # [n, k]
        q = torch.cat([student, tail_logprob(student)[:, None]], dim=-1)  # [n, k + 1] log-probabilities
        p = torch.cat([teacher.logprobs, teacher.tail[:, None]], dim=-1).to(q.dtype)
        p = p - torch.logsumexp(p, dim=-1, keepdim=True)  # the float16 cache sums to 1 only to ~1e-3
        if config.divergence == "forward":
            kl = (p.exp() * (p - q)).sum()
        else:
            kl = (q.exp() * (q - p)).sum()
        total = total + config.kd_weight * config.temperature**2 * kl
    if config.kd_weight < 1:
        total = total + (1 - config.kd_weight) * F.cross_entropy(scores, targets, reduction="sum")
    return total


class DistillObjective:
    """The trainer's objective (leanlm.train.trainer.Objective) for a student learning from a cached teacher."""

    def __init__(self, config: DistillConfig, cache: TeacherCache) -> None:
        self.config, self.cache = config, cache

    def identity(self) -> dict:
        return {"method": "distill", **self.cache.identity, **dataclasses.asdict(self.config)}

    def backward(self, model: nn.Module, input_ids: torch.Tensor, rows: list[int], scale: float) -> float:
        loss = self.loss(model, input_ids, rows)
        (loss * scale).backward()
        return float(loss.detach())

    def loss(self, model: nn.Module, input_ids: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Mean loss per scored position of the micro-batch [B, T]. Like causal_lm_loss, the head and loss run
        CHUNK positions at a time under checkpointing, so the [B*T, V] scores never exist at once."""
        hidden = hidden_states(model, input_ids)[:, :-1].reshape(-1, model.config.hidden_size)  # [N, hidden]
        targets = input_ids[:, 1:].reshape(-1)  # [N]
        teacher = self.cache.targets(rows, input_ids.device)
        k = teacher.indices.shape[-1]
        flat = TeacherTargets(teacher.indices.reshape(-1, k), teacher.logprobs.reshape(-1, k), teacher.tail.reshape(-1))
        total = hidden.new_zeros((), dtype=torch.float32)
        if self.config.cosine_weight > 0:
            total = total + self.config.cosine_weight * cosine_distance_sum(hidden, teacher.hidden)
        for start in range(0, hidden.shape[0], CHUNK):
            rows_ = slice(start, start + CHUNK)
            part = TeacherTargets(flat.indices[rows_], flat.logprobs[rows_], flat.tail[rows_])
            total = total + torch.utils.checkpoint.checkpoint(
                _head_loss_sum, model, hidden[rows_], targets[rows_], part, self.config, use_reentrant=False
            )
        return total / targets.numel()


def cosine_distance_sum(student: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    """Sum over positions of 1 - cos(student, teacher): student hidden [N, hidden], the cached teacher's [..., hidden]
    (DistilBERT's L_cos, in float32 whatever the autocast)."""
    if teacher is None:
        raise ValueError("the teacher cache holds no hidden states: build it with cosine_weight > 0")
    teacher = teacher.reshape(-1, teacher.shape[-1])
    if teacher.shape != student.shape:
        raise ValueError(
            f"the cosine loss compares hidden states of one width: the student's are {student.shape[-1]} wide, "
            f"the teacher's {teacher.shape[-1]}; set cosine_weight to 0 for a student of another width"
        )
    return (1 - F.cosine_similarity(student.float(), teacher.float(), dim=-1)).sum()


def _head_loss_sum(model: nn.Module, hidden, targets, teacher: TeacherTargets, config: DistillConfig):
    return distillation_loss_sum(model.compute_logits(hidden), targets, teacher, config)


def rows_read(data: TokenWindows, config: TrainConfig) -> set[int]:
    """Every training window a run of `config` reads (a resumed run included)."""
    micro_batches = config.total_steps * config.grad_accum
    return {r for i in range(micro_batches) for r in data.rows(i, config.batch_size, config.seed)}


def prepare_teacher(
    teacher: nn.Module,
    teacher_name: str,
    data: TokenWindows,
    train_config: TrainConfig,
    config: DistillConfig,
    directory,
    progress: bool = True,
) -> TeacherCache:
    """The teacher cache in `directory`, with every window the run will read (computed now where missing)."""
    identity = TeacherCache.identity_of(
        teacher_name, data.train, config.top_k, config.temperature, train_config.dtype, config.cosine_weight > 0
    )
    cache = TeacherCache(directory, identity)
    device = teacher.model.norm.weight.device
    with torch.autocast(device.type, DTYPES[train_config.dtype], enabled=train_config.dtype != "float32"):
        cache.build(teacher.eval(), data.train, rows_read(data, train_config), train_config.batch_size, progress)
    return cache
