"""Early-exit heads trained on a frozen model (CALM, Schuster et al. 2022; LayerSkip, Elhoushi et al. 2024): each
exit learns to make the shared LM head, reading layer K's residual stream, match the whole model's distribution.
One frozen forward per batch gives every exit its input; only the heads train. Also CALM's confidence measures
and a per-exit threshold calibration on held-out text.

    attach_exits(model, ExitHeadsConfig(layers=(8, 16, 24)))
    result = ExitTrainer(model, TokenWindows.from_ids(ids, 256), TrainConfig(tokens=100_000, lr=1e-3)).run()
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leanlm.model.exit_head import build_exits
from leanlm.train.data import TokenWindows
from leanlm.train.forward import residual_stream
from leanlm.train.trainer import DTYPES, TrainConfig


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class ExitHeadsConfig:
    layers: tuple[int, ...] = _opt((8, 16, 24), "layer counts that get an exit (after K layers), increasing")
    temperature: float = _opt(1.0, "temperature of the KL to the final layer's distribution (scaled back by T^2)")
    ce_weight: float = _opt(0.0, "weight of the hard-label next-token cross entropy added to the KL")
    adapter_rank: int = _opt(0, "0: each exit is an RMSNorm (from the final norm); r: plus a rank-r residual adapter")

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 1:
            raise ValueError(f"exit layers must be increasing layer counts >= 1, e.g. (8, 16, 24); got {self.layers}")
        if self.temperature <= 0 or self.ce_weight < 0 or self.adapter_rank < 0:
            raise ValueError("need temperature > 0, ce_weight >= 0 and adapter_rank >= 0")

    def check_model(self, num_hidden_layers: int) -> None:
        if self.layers[-1] >= num_hidden_layers:
            raise ValueError(
                f"an exit after {self.layers[-1]} layers needs a model of more layers; this one has "
                f"{num_hidden_layers}: use exits below it"
            )


def attach_exits(model: nn.Module, config: ExitHeadsConfig) -> nn.Module:
    """Give `model` fresh exits at `config.layers` (replacing any it had), each equal to the untrained exit
    (the final norm); its config records them, so save_checkpoint writes them and loading rebuilds them."""
    config.check_model(model.config.num_hidden_layers)
    final_norm = model.model.norm
    model.config = dataclasses.replace(
        model.config, exit_layers=tuple(config.layers), exit_adapter_rank=config.adapter_rank
    )
    exits = build_exits(model.config.hidden_size, model.config.rms_norm_eps, config.layers, config.adapter_rank)
    with torch.no_grad():
        exits = exits.to(device=final_norm.weight.device, dtype=torch.float32)
        for head in exits.values():
            head.reset_from(final_norm)
    model.model.exits = exits.to(final_norm.weight.dtype).requires_grad_(False)
    return model


def exit_layers(model: nn.Module) -> tuple[int, ...]:
    return tuple(int(k) for k in model.model.exits)


# ----------------------------------------------------------------------------------------- confidence


def softmax_max(logits: torch.Tensor) -> torch.Tensor:
    """CALM's softmax response: the top probability of each row, logits [N, V] -> [N]."""
    return logits.float().softmax(dim=-1).amax(dim=-1)


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """The gap between each row's two largest probabilities, logits [N, V] -> [N]."""
    top = logits.float().softmax(dim=-1).topk(2, dim=-1).values  # [N, 2]
    return top[:, 0] - top[:, 1]


def saturation(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """CALM's hidden-state saturation: cosine similarity of each token's hidden state before and after a layer,
    [N, hidden] x2 -> [N] (near 1: the layer barely moved it)."""
    return F.cosine_similarity(before.float(), after.float(), dim=-1)


CONFIDENCE_MEASURES = ("softmax", "gap", "saturation")


@dataclass
class ExitStatistics:
    """Per held-out token (N of them) at one exit, teacher-forced against the whole model."""

    layer: int
    kl: torch.Tensor  # [N] KL(whole model || exit) in nats, temperature 1
    agrees: torch.Tensor  # [N] bool: the exit's argmax is the whole model's
    confidence: dict[str, torch.Tensor]  # [N] per measure in CONFIDENCE_MEASURES

    @property
    def mean_kl(self) -> float:
        return float(self.kl.mean())

    @property
    def agreement(self) -> float:
        return float(self.agrees.float().mean())


@torch.no_grad()
def exit_statistics(
    model: nn.Module, windows: torch.Tensor, batch_size: int = 4, dtype: str = "float32", chunk: int = 512
) -> dict[int, ExitStatistics]:
    """Every exit of `model` on `windows` [N, T] (all positions): KL to and agreement with the final layer, and
    each confidence measure. The heads run `chunk` rows at a time (49k-way logits)."""
    layers = exit_layers(model)
    device = model.model.norm.weight.device
    parts: dict[int, list[tuple]] = {k: [] for k in layers}
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size].to(device)
        with torch.autocast(device.type, DTYPES[dtype], enabled=dtype != "float32"):
            streams, final = _streams(model, ids, {k - 1 for k in layers} | set(layers))
            for rows in _row_chunks(final.shape[0], chunk):
                teacher = model.compute_logits(final[rows]).float().log_softmax(dim=-1)  # [n, V]
                for k in layers:
                    scores = model.compute_logits(model.model.exits[str(k)](streams[k][rows])).float()  # [n, V]
                    kl = F.kl_div(scores.log_softmax(dim=-1), teacher, log_target=True, reduction="none").sum(-1)
                    sat = saturation(streams[k - 1][rows], streams[k][rows])
                    agrees = scores.argmax(dim=-1) == teacher.argmax(dim=-1)
                    parts[k].append((kl, agrees, softmax_max(scores), top2_gap(scores), sat))
    out = {}
    for k, chunks in parts.items():
        kl, agrees, smax, gap, sat = (torch.cat(column).cpu() for column in zip(*chunks))
        out[k] = ExitStatistics(k, kl, agrees, {"softmax": smax, "gap": gap, "saturation": sat})
    return out


@dataclass(frozen=True)
class ExitCalibration:
    layer: int
    measure: str  # one of CONFIDENCE_MEASURES
    threshold: float | None  # exit when confidence >= threshold; None: no threshold reaches the consistency
    exit_fraction: float  # share of held-out tokens whose confidence reaches the threshold
    agreement: float  # share of those that agree with the whole model's greedy token


def calibrate_threshold(stats: ExitStatistics, measure: str = "softmax", consistency: float = 0.95) -> ExitCalibration:
    """The smallest threshold at which the tokens confident enough to exit at this exit agree with the whole
    model's greedy token at least `consistency` of the time (each exit on its own, all held-out tokens)."""
    if measure not in CONFIDENCE_MEASURES:
        raise ValueError(f"unknown confidence measure {measure!r}; use one of {', '.join(CONFIDENCE_MEASURES)}")
    if not 0 < consistency <= 1:
        raise ValueError(f"consistency must be in (0, 1], got {consistency}")
    conf, order = stats.confidence[measure].sort(descending=True)
    agree = stats.agrees[order].double()
    count = torch.arange(1, len(conf) + 1)
    precision = agree.cumsum(0) / count  # agreement of the `count` most confident tokens
    # a threshold can only sit where the confidence drops: ties exit together
    boundary = torch.ones_like(conf, dtype=torch.bool)
    boundary[:-1] = conf[:-1] > conf[1:]
    ok = (precision >= consistency - 1e-12) & boundary
    if not ok.any():
        return ExitCalibration(stats.layer, measure, None, 0.0, 0.0)
    n = int(ok.nonzero().max()) + 1
    return ExitCalibration(stats.layer, measure, float(conf[n - 1]), n / len(conf), float(precision[n - 1]))


# ------------------------------------------------------------------------------------------- training


def _streams(model: nn.Module, ids: torch.Tensor, keep: set[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One frozen forward of ids [B, T]: the residual stream after each layer count in `keep`, flattened to
    [B*T, hidden], and the final-normed hidden [B*T, hidden]."""
    streams, hidden = {}, model.config.hidden_size
    with torch.no_grad():
        for count, x in enumerate(residual_stream(model, ids)):
            if count in keep:
                streams[count] = x.reshape(-1, hidden)
        final = model.model.norm(x).reshape(-1, hidden)
    return streams, final


def _row_chunks(num_rows: int, chunk: int):
    return [slice(s, s + chunk) for s in range(0, num_rows, chunk)]


def exit_loss_backward(
    model: nn.Module, ids: torch.Tensor, config: ExitHeadsConfig, scale: float = 1.0, chunk: int = 512
) -> tuple[float, dict[int, float]]:
    """Backpropagate `scale` x the summed per-exit loss on ids [B, T] into the exits' gradients, and return that
    loss (unscaled) and each exit's KL part. The loss of an exit: mean per-token T^2 KL(final || exit, at T)
    + ce_weight x next-token CE. The model is frozen, so the terms of different rows and exits share no graph:
    each (rows, exit) term goes backward at once and no [n, V] logits outlive it."""
    streams, final = _streams(model, ids, set(config.layers))
    batch, seq = ids.shape
    targets = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).reshape(-1)  # [B*T]
    scored = (torch.arange(seq, device=ids.device) < seq - 1).repeat(batch)  # [B*T]: the last position has no next
    num_scored = int(scored.sum())
    total, parts = 0.0, dict.fromkeys(config.layers, 0.0)
    for rows in _row_chunks(final.shape[0], chunk):
        with torch.no_grad():
            teacher = (model.compute_logits(final[rows]).float() / config.temperature).log_softmax(dim=-1)  # [n, V]
        for k in config.layers:
            scores = model.compute_logits(model.model.exits[str(k)](streams[k][rows])).float()  # [n, V]
            log_q = (scores / config.temperature).log_softmax(dim=-1)
            kl = (F.kl_div(log_q, teacher, log_target=True, reduction="none").sum(-1) * scored[rows]).sum()
            loss = config.temperature**2 * kl
            if config.ce_weight:
                ce = F.cross_entropy(scores, targets[rows], reduction="none")
                loss = loss + config.ce_weight * (ce * scored[rows]).sum()
            (loss * (scale / num_scored)).backward()
            total += float(loss.detach()) / num_scored
            parts[k] += float(kl.detach()) / num_scored
    return total, parts


@dataclass
class ExitTrainResult:
    steps: int
    tokens: int  # tokens trained on, this run and any it resumed
    seconds: float  # wall time of the steps, this run and any it resumed
    resumed_from: int  # the step the run started at (0 = fresh)
    losses: list[float] = field(default_factory=list)  # training loss of each step (summed over exits)
    held_out: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (step, {exit: held-out KL})

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class ExitTrainer:
    """Trains the exits already attached to a frozen `model` (attach_exits) to `config`'s token budget, with its
    learning-rate schedule, resuming from `state_path` like leanlm.train.trainer.Trainer."""

    def __init__(
        self,
        model: nn.Module,
        data: TokenWindows,
        config: TrainConfig,
        exits: ExitHeadsConfig,
        state_path: str | Path | None = None,
        progress: bool = True,
    ) -> None:
        if data.train.shape[1] != config.seq_len:
            raise ValueError(f"data windows have {data.train.shape[1]} tokens, config.seq_len is {config.seq_len}")
        if exit_layers(model) != exits.layers:
            raise ValueError(f"the model's exits are at {exit_layers(model)}, not {exits.layers}: attach_exits first")
        self.model, self.data, self.config, self.exits, self.progress = model, data, config, exits, progress
        self.state_path = None if state_path is None else Path(state_path)
        model.eval().requires_grad_(False)
        self.heads = model.model.exits.float().requires_grad_(True)  # the master weights train in float32
        params = list(self.heads.parameters())
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)
        self.result = ExitTrainResult(0, 0, 0.0, 0)

    def run(self) -> ExitTrainResult:
        cfg = self.config
        start_step = self._resume()
        bar = tqdm(
            range(start_step, cfg.total_steps),
            desc="training exits",
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
            done = step + 1 == cfg.total_steps
            if done or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                self.result.held_out.append((step + 1, self.held_out_kl()))
            if self.state_path is not None and cfg.save_every and ((step + 1) % cfg.save_every == 0 or done):
                self.save_state()
        self.heads.requires_grad_(False)
        step = {"method": "exits", **dataclasses.asdict(self.exits), "train": dataclasses.asdict(cfg)}
        self.model.compression_recipe = [*getattr(self.model, "compression_recipe", []), step]
        return self.result

    def _step(self, step: int) -> float:
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        total = 0.0
        device = self.model.model.norm.weight.device
        for micro in range(cfg.grad_accum):
            ids = self.data.batch(step * cfg.grad_accum + micro, cfg.batch_size, cfg.seed).to(device)
            with torch.autocast(device.type, DTYPES[cfg.dtype], enabled=cfg.dtype != "float32"):
                loss, _ = exit_loss_backward(self.model, ids, self.exits, scale=1 / cfg.grad_accum)
            total += loss / cfg.grad_accum
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(list(self.heads.parameters()), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def held_out_kl(self) -> dict[int, float]:
        """Mean KL(final || exit) per exit on the held-out windows."""
        stats = exit_statistics(self.model, self.data.held_out, self.config.batch_size, self.config.dtype)
        return {k: s.mean_kl for k, s in stats.items()}

    # the state file follows Trainer's: identity check, written to a temporary file and renamed

    def _identity(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "exits": dataclasses.asdict(self.exits)}

    def save_state(self) -> None:
        state = {
            **self._identity(),
            "heads": self.heads.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "result": dataclasses.asdict(self.result),
        }
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def _resume(self) -> int:
        if self.state_path is None or not self.state_path.is_file():
            return 0
        state = torch.load(self.state_path, weights_only=False)
        saved = {k: state.get(k) for k in self._identity()}
        if saved != self._identity():
            raise ValueError(
                f"{self.state_path} holds a run with other settings ({saved}); use another --out or delete it"
            )
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.result = ExitTrainResult(
            **{**state["result"], "held_out": [tuple(x) for x in state["result"]["held_out"]]}
        )
        self.result.resumed_from = self.result.steps
        return self.result.steps


def train_exits(
    model: nn.Module,
    data: TokenWindows,
    config: TrainConfig,
    exits: ExitHeadsConfig,
    state_path: str | Path | None = None,
    progress: bool = True,
) -> ExitTrainResult:
    """Attach fresh exits to `model` and train them (see ExitTrainer); the model's own weights do not change."""
    attach_exits(model, exits)
    return ExitTrainer(model, data, config, exits, state_path, progress).run()
