"""Early-exit heads trained on a frozen model (CALM, Schuster et al. 2022; LayerSkip, Elhoushi et al. 2024): each
exit learns to make the shared LM head, reading layer K's residual stream, match the whole model's distribution.
One frozen forward per batch gives every exit its input; only the heads train, in the trainer's loop
(ExitObjective). Also CALM's confidence measures and a per-exit threshold calibration on held-out text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.config import EXIT_MEASURES
from leanlm.model.exit_head import build_exits, saturation, softmax_max, top2_gap
from leanlm.model.forward import residual_stream
from leanlm.train.trainer import DTYPES, _opt


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


CONFIDENCE_MEASURES = EXIT_MEASURES  # the engine's early exit reads the same three


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


class ExitObjective:
    """The trainer's objective (leanlm.train.trainer.Objective) for exit heads attached to a frozen model
    (attach_exits): only the heads train, and the held-out measure is each exit's KL to the final layer.

        attach_exits(model, exits)
        Trainer(model, data, TrainConfig(tokens=100_000, lr=1e-3), objective=ExitObjective(exits)).run()
    """

    def __init__(self, config: ExitHeadsConfig) -> None:
        self.config = config

    def identity(self) -> dict:
        return {"method": "exits", **dataclasses.asdict(self.config)}

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        if exit_layers(model) != self.config.layers:
            raise ValueError(
                f"the model's exits are at {exit_layers(model)}, not {self.config.layers}: attach_exits first"
            )
        return list(model.model.exits.parameters())

    def backward(self, model: nn.Module, input_ids: torch.Tensor, rows: list[int], scale: float) -> float:
        return exit_loss_backward(model, input_ids, self.config, scale)[0]

    def held_out(self, model: nn.Module, windows: torch.Tensor, batch_size: int, dtype: str) -> dict[int, float]:
        """Mean KL(final || exit) per exit on the held-out windows."""
        return {k: s.mean_kl for k, s in exit_statistics(model, windows, batch_size, dtype).items()}
