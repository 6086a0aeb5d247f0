"""TrainJob and DistillJob: everything one `leanlm train` / `leanlm distill` run needs, as frozen data checked on
construction (before any model loads); leanlm.train.run / run_distill carry them out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from leanlm.compress.base import MethodConfig
from leanlm.compress.quantize.rtn import RTNConfig
from leanlm.compress.transform.gqa import GQAConfig
from leanlm.compress.transform.upcycle import UpcycleConfig
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.train.distill import DistillConfig
from leanlm.train.exits import ExitHeadsConfig
from leanlm.train.lora import LoRATrainConfig
from leanlm.train.recipes import TRAINING_CONFIGS
from leanlm.train.trainer import TrainConfig

RECIPES = ("finetune", *TRAINING_CONFIGS)  # what `--recipe` names: plain fine-tuning or a training-time sparsity
DEFAULT_CACHE_DIR = "teacher_cache"  # OUT/DEFAULT_CACHE_DIR: a distillation's teacher top-k without --teacher-cache
STATE_FILE = "train_state.pt"  # OUT/STATE_FILE: a run's resumable state, removed when it completes


def build_sparsity(
    recipe: str,
    sparsity: float | None = None,
    pattern: str | None = None,
    decay: float | None = None,
    backward_sparsity: float | None = None,
    rounds: int | None = None,
) -> MethodConfig | None:
    """The training-time sparsity config a recipe name and its options make (None for plain fine-tuning)."""
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


def _check_out(out: Path, sources: list[str | None], overwrite: bool, own_files: tuple[str, ...]) -> None:
    """Refuse an output directory before the run (formats/output_dir.py): one that holds a run's state is that
    run's own (it resumes and replaces its checkpoint); another non-empty one needs overwrite."""
    from leanlm.formats.output_dir import check_output_dir

    check_output_dir(out, sources, overwrite=overwrite or (out / STATE_FILE).is_file(), own_files=own_files)


def _check_data(data: str | None) -> None:
    if data is not None and not Path(data).is_file():
        raise ValueError(f"training text {data} does not exist; pass a text file (or a MediaWiki .bz2 dump)")


@dataclass(frozen=True)
class TrainJob:
    """One fine-tuning run: what it starts from, what it learns, where it goes. At most one of sparsity, QAT
    (qat or train_quantized) and exits; gqa goes with anything but exits; upcycle with plain fine-tuning, GQA
    and --qat-bits."""

    out: Path  # the checkpoint directory; the run's resumable state lives there too (STATE_FILE)
    model: str = DEFAULT_MODEL  # bundled model name, GGUF file or HF directory
    train: TrainConfig = field(default_factory=TrainConfig)  # token budget, optimizer, windows
    sparsity: MethodConfig | None = None  # a TRAINING_CONFIGS config (build_sparsity); None: dense fine-tuning
    gqa: GQAConfig | None = None  # convert to fewer K/V heads first (GQA / MQA uptraining)
    upcycle: UpcycleConfig | None = None  # make the dense model a mixture of experts first (sparse upcycling, PR-MoE)
    qat: RTNConfig | None = None  # quantization-aware training: RTN to these bits first, then fake-quantized
    train_quantized: bool = False  # QAT of the checkpoint's own int8 / 2-4 bit layers (not with qat)
    exits: ExitHeadsConfig | None = None  # train early-exit heads on the frozen model instead
    # train a LoRA adapter on the frozen model (any weight format: a quantized base is QLoRA) and write it in PEFT's
    # format to `out` instead of a checkpoint
    lora: LoRATrainConfig | None = None
    data: str | None = None  # training text (None: gensim's Wikipedia articles)
    held_out: int = 4  # windows at the end of the text kept for held-out loss
    keep_state: bool = False  # keep OUT/STATE_FILE after the run completes
    device: str | None = None  # cpu | cuda (None: cuda when present)
    overwrite: bool = False  # replace a non-empty `out` that holds no run state (never the model or data it reads)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if self.train_quantized and self.qat is not None:
            raise ValueError(
                "--qat trains the checkpoint's quantized layers, --qat-bits quantizes with RTN first: pick one"
            )
        if self.sparsity is not None and type(self.sparsity) not in TRAINING_CONFIGS.values():
            raise TypeError(f"sparsity must be one of the training configs {', '.join(TRAINING_CONFIGS)}")
        if (self.qat is not None or self.train_quantized) and self.sparsity is not None:
            raise ValueError(f"QAT trains a quantized model: it does not combine with --recipe {self.sparsity.name}")
        _check_data(self.data)
        if self.exits is not None and (self.sparsity is not None or self.is_qat or self.gqa is not None):
            raise ValueError("--exits trains heads on a frozen model: it does not combine with a recipe, QAT or GQA")
        if self.upcycle is not None and (self.exits is not None or self.train_quantized or self.sparsity is not None):
            raise ValueError(
                "--upcycle-experts copies the float MLPs into experts and trains them all: it does not combine with "
                "--exits, --qat or a sparsity recipe (upcycle and fine-tune first, then prune or quantize the result)"
            )
        others = [self.sparsity, self.gqa, self.upcycle, self.exits, self.qat if self.is_qat else None]
        if self.lora is not None and any(x is not None for x in others):
            raise ValueError(
                "--lora trains an adapter on the frozen model: it does not combine with a recipe, QAT, GQA, upcycling "
                "or exits (to train on a quantized model, pass the quantized checkpoint as --model: QLoRA)"
            )
        _check_out(self.out, [self.model, self.data], self.overwrite, self.own_files)

    @property
    def own_files(self) -> tuple[str, ...]:
        """What the run itself keeps in `out` besides the checkpoint: kept when the checkpoint is written."""
        return (STATE_FILE,)

    @property
    def is_qat(self) -> bool:
        return self.qat is not None or self.train_quantized

    @property
    def state_path(self) -> Path:
        return self.out / STATE_FILE


@dataclass(frozen=True)
class DistillJob:
    """One distillation run: a student (a checkpoint, or the teacher's layers) trained on the teacher."""

    out: Path  # the checkpoint directory; the run's resumable state lives there too (STATE_FILE)
    teacher: str = DEFAULT_MODEL  # bundled model name, GGUF file or HF directory
    student: str | None = None  # a student checkpoint with the teacher's vocabulary (None: the teacher's layers)
    keep_layers: tuple[int, ...] | None = None  # the teacher with these layers
    num_student_layers: int | None = None  # the teacher with this many layers, evenly spaced (None: half)
    qat: bool = False  # the student is quantized: its int8 / 2-4 bit layers train through fake quantization
    distill: DistillConfig = field(default_factory=DistillConfig)  # the teacher term and its weight
    train: TrainConfig = field(default_factory=TrainConfig)
    teacher_cache: Path | None = None  # where the teacher's top-k lives (None: OUT/teacher_cache)
    data: str | None = None  # training text (None: gensim's Wikipedia articles)
    held_out: int = 4  # windows at the end of the text kept for held-out loss
    keep_state: bool = False  # keep OUT/STATE_FILE after the run completes
    device: str | None = None  # cpu | cuda (None: cuda when present)
    overwrite: bool = False  # replace a non-empty `out` that holds no run state (never the models or data it reads)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        given = [self.student is not None, self.keep_layers is not None, self.num_student_layers is not None]
        if sum(given) > 1:
            raise ValueError("name the student one way: a checkpoint, the layers to keep, or how many layers")
        if self.qat and self.student is None:
            raise ValueError("--qat trains a quantized student: pass it with --student DIR (leanlm quantize's output)")
        _check_data(self.data)
        _check_out(self.out, [self.teacher, self.student, self.data], self.overwrite, self.own_files)

    @property
    def own_files(self) -> tuple[str, ...]:
        """What the run itself keeps in `out` besides the checkpoint (its state, the default teacher cache)."""
        return (STATE_FILE, DEFAULT_CACHE_DIR)

    @property
    def state_path(self) -> Path:
        return self.out / STATE_FILE

    @property
    def cache_dir(self) -> Path:
        return self.teacher_cache if self.teacher_cache is not None else self.out / DEFAULT_CACHE_DIR
