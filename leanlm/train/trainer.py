"""The fine-tuning loop: AdamW on float32 master weights, bf16 autocast, gradient accumulation, a token budget,
warmup + cosine learning rate, held-out loss, and a resumable state file written every few steps.

    result = train(model, TokenWindows.from_ids(ids, 512), TrainConfig(tokens=500_000), SRSTEConfig(pattern="2:4"))

A training-time sparsity method (leanlm.train.sparse) rides on the same loop: it masks the weights the forward
sees and moves its masks between optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.compress.base import MethodConfig
from leanlm.model.forward import causal_lm_loss
from leanlm.train.balance import RoutingBalance, add_load
from leanlm.train.data import TokenWindows
from leanlm.train.recipes import build_sparse_training
from leanlm.train.sparse import SparseTraining

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = _opt(200_000, "training token budget, in whole optimizer steps")
    seq_len: int = _opt(512, "tokens per training window")
    batch_size: int = _opt(4, "windows per forward")
    grad_accum: int = _opt(2, "forwards per optimizer step (gradient accumulation)")
    lr: float = _opt(2e-5, "peak learning rate: linear warmup to it, cosine down to lr * min-lr-ratio")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = _opt(10, "optimizer steps of linear warmup")
    weight_decay: float = _opt(0.0, "AdamW's decoupled weight decay on matrices (never on norms)")
    grad_clip: float = _opt(1.0, "max global gradient norm; 0 = no clipping")
    dtype: str = _opt(
        "bfloat16", "compute dtype of the forward (autocast); weights stay float32", choices=("bfloat16", "float32")
    )
    eval_every: int = _opt(50, "steps between held-out losses (always at the end too); 0 = only at the end")
    save_every: int = _opt(20, "steps between writes of the resumable state; 0 = never")
    seed: int = _opt(0, "seeds the order of the training windows")
    max_seconds: float = _opt(
        0.0,
        "wall-clock budget: stop after the step that reaches this many training seconds (0 = none); the "
        "learning-rate schedule still follows --tokens",
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("seq_len", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tokens < self.tokens_per_step:
            raise ValueError(
                f"a budget of {self.tokens} tokens is less than one optimizer step "
                f"({self.batch_size} x {self.seq_len} x {self.grad_accum} = {self.tokens_per_step}); raise --tokens"
            )
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup_steps >= 0 and self.grad_clip >= 0):
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0 and grad_clip >= 0")
        if self.eval_every < 0 or self.save_every < 0 or self.weight_decay < 0 or not self.max_seconds >= 0:
            raise ValueError("eval_every, save_every, weight_decay and max_seconds must be >= 0")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.grad_accum

    @property
    def total_steps(self) -> int:
        return self.tokens // self.tokens_per_step

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Objective(Protocol):
    """What a run minimizes, when it is not the whole model's next-token loss: a teacher's distribution
    (leanlm.train.distill), or early-exit heads on a frozen model (leanlm.train.exits). It may also define
    `parameters(model)`, the parameters that train (default: every float one), and `held_out(model, windows,
    batch_size, dtype)`, its held-out measure (default: the next-token loss)."""

    def backward(self, model: nn.Module, input_ids: torch.Tensor, rows: list[int], scale: float) -> float:
        """Backpropagate `scale` x the mean loss of the micro-batch input_ids [B, T] (the training windows
        numbered `rows`); return the loss, unscaled."""
        ...

    def identity(self) -> dict:
        """Its settings, which a resumed run must match, and which the checkpoint's recipe records."""
        ...


@dataclass
class TrainResult:
    steps: int
    tokens: int  # tokens trained on, this run and any it resumed
    seconds: float  # wall time of the steps, this run and any it resumed
    resumed_from: int  # the step the run started at (0 = fresh)
    losses: list[float] = field(default_factory=list)  # training loss of each step
    held_out: list[tuple[int, float | dict]] = field(default_factory=list)  # (step, held-out loss or measure)
    sparsity: dict[str, float] = field(default_factory=dict)  # the sparsity method's summary
    # MoE models: each step's load-balancing loss (unweighted; 1.0 = uniform routing), and the assignments each
    # sparse layer's router made to each expert over the run, {layer_idx: [E]} (leanlm.train.balance.layer_loads)
    balance_losses: list[float] = field(default_factory=list)
    expert_load: dict[int, list[int]] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class Trainer:
    """One run: `run()` trains to the budget (resuming from `state_path` when it holds an earlier run's state)."""

    def __init__(
        self,
        model: nn.Module,
        data: TokenWindows,
        config: TrainConfig,
        sparsity: MethodConfig | None = None,
        state_path: str | Path | None = None,
        progress: bool = True,
        objective: Objective | None = None,
    ) -> None:
        if data.train.shape[1] != config.seq_len:
            raise ValueError(f"data windows have {data.train.shape[1]} tokens, config.seq_len is {config.seq_len}")
        self.model, self.data, self.config, self.progress = model, data, config, progress
        self.sparsity_config, self.objective = sparsity, objective
        self.state_path = None if state_path is None else Path(state_path)
        self.sparse: SparseTraining | None = None if sparsity is None else build_sparse_training(sparsity)
        model.train().requires_grad_(False)
        if objective is not None and hasattr(objective, "parameters"):
            trainable = objective.parameters(model)
        else:
            trainable = [p for p in model.parameters() if p.is_floating_point()]
        for p in trainable:
            p.requires_grad_(True)
        if self.sparse is not None:
            self.sparse.attach(model)
        # MoE layers: Switch's balancing loss joins the next-token loss (the objectives' own losses go without it)
        self.balance = RoutingBalance.of(model) if objective is None else None
        self.optimizer = self._new_optimizer()
        self.result = TrainResult(0, 0, 0.0, 0)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over matrices (decayed) and the rest (not), and a group of its own for each `lr_scale` a
        parameter asks for (fake-quantized grids: leanlm.model.quantized.fake_quant.GRID_LR_SCALE)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = {(True, 1.0): [], (False, 1.0): []}  # always these two first: older saved states have just them
        for p in params:
            groups.setdefault((p.dim() >= 2, getattr(p, "lr_scale", 1.0)), []).append(p)
        param_groups = [
            {"params": ps, "weight_decay": self.config.weight_decay if matrix else 0.0, "lr_scale": scale}
            for (matrix, scale), ps in groups.items()
        ]
        return torch.optim.AdamW(param_groups, lr=self.config.lr, betas=(0.9, 0.95), eps=1e-8)

    # ------------------------------------------------------------------------------------------ loop

    def run(self) -> TrainResult:
        cfg = self.config
        start_step = self._resume()
        out_of_time = 0 < cfg.max_seconds <= self.result.seconds  # a resumed run that had spent its budget
        if start_step == 0 and self.sparse is not None:
            self.sparse.refresh(0, cfg.total_steps)
        bar = tqdm(
            range(start_step, start_step if out_of_time else cfg.total_steps),
            desc="training",
            unit="step",
            initial=start_step,
            total=cfg.total_steps,
            disable=not self.progress,
        )
        for step in bar:
            began = time.perf_counter()
            loss = self._step(step)
            self.result.seconds += time.perf_counter() - began
            self.result.steps, self.result.tokens = step + 1, (step + 1) * cfg.tokens_per_step
            self.result.losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{self.result.tokens_per_second:.0f}")
            # a wall-clock budget counts the steps' seconds, a resumed run's included
            done = step + 1 == cfg.total_steps or 0 < cfg.max_seconds <= self.result.seconds
            if done or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                self.result.held_out.append((step + 1, self.held_out_loss()))
            if self.state_path is not None and cfg.save_every and ((step + 1) % cfg.save_every == 0 or done):
                self.save_state()
            if done:
                break
        if self.sparse is not None:
            self.result.sparsity = self.sparse.finish()
        self.model.eval().requires_grad_(False)
        return self.result

    def _step(self, step: int) -> float:
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(step) * group.get("lr_scale", 1.0)
        total = 0.0
        for micro in range(cfg.grad_accum):
            rows = self.data.rows(step * cfg.grad_accum + micro, cfg.batch_size, cfg.seed)
            ids = self.data.train[rows].to(self.model.model.norm.weight.device)
            with torch.autocast(ids.device.type, DTYPES[cfg.dtype], enabled=cfg.dtype != "float32"):
                if self.objective is None:
                    loss = self.lm_loss(ids) / cfg.grad_accum
                    loss.backward()
                    total += float(loss.detach())
                else:
                    total += self.objective.backward(self.model, ids, rows, 1 / cfg.grad_accum) / cfg.grad_accum
        if self.balance is not None:
            self.result.expert_load = add_load(self.result.expert_load, self.balance.take_counts())
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sparse is not None and self.sparse.refresh(step + 1, cfg.total_steps):
            self.optimizer = self._new_optimizer()  # weights were rewound: their moments no longer apply
        return total

    def lm_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """The loss a plain run minimizes on ids [B, T]: next-token cross entropy, plus router_aux_loss_coef x the
        balancing loss in a model with experts (whose unweighted value goes to result.balance_losses)."""
        loss = causal_lm_loss(self.model, ids)
        if self.balance is None:
            return loss
        aux = self.balance.loss()
        if len(self.result.balance_losses) <= self.result.steps:
            self.result.balance_losses.append(0.0)
        self.result.balance_losses[-1] += float(aux.detach()) / self.config.grad_accum
        return loss + self.balance.coef * aux

    @torch.no_grad()
    def held_out_loss(self) -> float | dict:
        """Mean next-token loss on the held-out windows (the end of the training text), so runs with different
        objectives compare on it; or the objective's own held-out measure where it has one (exit heads: the
        model's loss does not move)."""
        cfg, device = self.config, self.model.model.norm.weight.device
        if self.objective is not None and hasattr(self.objective, "held_out"):
            return self.objective.held_out(self.model, self.data.held_out, cfg.batch_size, cfg.dtype)
        was_training = self.model.training
        self.model.eval()
        losses = []
        for start in range(0, self.data.held_out.shape[0], cfg.batch_size):
            ids = self.data.held_out[start : start + cfg.batch_size].to(device)
            with torch.autocast(device.type, DTYPES[cfg.dtype], enabled=cfg.dtype != "float32"):
                losses.append(float(causal_lm_loss(self.model, ids)) * ids.shape[0])
        self.model.train(was_training)
        return sum(losses) / self.data.held_out.shape[0]

    # ------------------------------------------------------------------------------------ resumption

    def _identity(self) -> dict:
        """What a saved state must match to be resumed: the run's settings and its sparsity method."""
        sparsity, config = self.sparsity_config, dataclasses.asdict(self.config)
        if not config["max_seconds"]:
            del config["max_seconds"]  # as states written before the option say it
        identity = {
            "config": config,
            "sparsity": None if sparsity is None else {"method": sparsity.name, **dataclasses.asdict(sparsity)},
        }
        if self.objective is not None:  # absent otherwise, so states written before objectives still resume
            identity["objective"] = self.objective.identity()
        return identity

    def save_state(self) -> None:
        """Everything a resumed run needs, written to a temporary file and renamed (a crash leaves the last
        complete state)."""
        state = {
            **self._identity(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sparse": None if self.sparse is None else self.sparse.state_dict(),
            "result": dataclasses.asdict(self.result),
        }
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def _resume(self) -> int:
        if self.state_path is None or not self.state_path.is_file():
            return 0
        # weights_only: a state holds tensors and plain data only, and unpickling anything else would run code
        # planted in the run directory before the identity check below could refuse it.
        try:
            state = torch.load(self.state_path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(
                f"{self.state_path} is not a training state LeanLM wrote (it holds objects other than tensors and "
                f"plain data, which are not loaded); delete it or use another --out"
            ) from e
        saved = {k: state.get(k) for k in self._identity()}
        if saved != self._identity():
            raise ValueError(
                f"{self.state_path} holds a run with other settings ({saved}); use another --out or delete it"
            )
        self.model.load_state_dict(state["model"])
        if self.sparse is not None:
            self.sparse.load_state_dict(state["sparse"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.result = TrainResult(**{**state["result"], "held_out": [tuple(x) for x in state["result"]["held_out"]]})
        self.result.resumed_from = self.result.steps
        return self.result.steps

    def recipe_step(self) -> dict:
        """This run as a recipe step (what a saved Checkpoint records: `checkpoint.with_recipe([step])`)."""
        step = {"method": "train", **dataclasses.asdict(self.config)}
        if self.sparsity_config is not None:
            step["sparsity"] = {"method": self.sparsity_config.name, **dataclasses.asdict(self.sparsity_config)}
        if self.objective is not None:
            step["objective"] = self.objective.identity()
        return step


def train(
    model: nn.Module,
    data: TokenWindows,
    config: TrainConfig,
    sparsity: MethodConfig | None = None,
    state_path: str | Path | None = None,
    progress: bool = True,
    objective: Objective | None = None,
) -> TrainResult:
    """Fine-tune `model` in place on `data` to the config's token budget (see Trainer)."""
    return Trainer(model, data, config, sparsity, state_path, progress, objective).run()
