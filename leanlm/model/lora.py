"""LoRA at run time (Hu et al. 2021) with many adapters in one batch (S-LoRA, Sheng et al. 2023; Punica, Chen et al.
2023): each target linear's output gains scale * (x A^T) B^T for the adapter of each row's request. The base layer is
never touched, so any runtime weight format (float, int4, int8, GGUF codes) takes adapters.

The stacked adapter weights (LoRASlots) belong to the engine, like the KV cache; one forward reaches them through its
ForwardContext's `lora` part (a LoRAMapping). The model holds no adapter state: `install_lora_hooks` adds to each target
linear a hook that reads the forward context and does nothing outside a LoRA batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.config import ModelConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# A step whose adapter rows form at most this many runs (prefill chunks, a few requests) adds each run's product on its
# rows; more runs (a decode batch over several adapters) take one product over the stacked slots, masked per row:
# benchmarks/lora.py measured both on SmolLM2 (docs/lora.md)
MAX_SEGMENT_RUNS = 4


def lora_target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Module name (HF's) -> (out, in) features of every linear an adapter may change: each layer's q/k/v/o projections
    (not MLA's latent ones) and the gate/up/down projections of its MLP where it is dense (not a sparse MoE block)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    attention = {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden)}
    attention["o_proj"] = (hidden, q_size)
    mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    shapes = {}
    for i in range(config.num_hidden_layers):
        if config.mla is None:
            shapes |= {f"model.layers.{i}.self_attn.{n}": s for n, s in attention.items()}
        if config.moe is None or not config.moe.is_sparse(i):
            shapes |= {f"model.layers.{i}.mlp.{n}": s for n, s in mlp.items()}
    return shapes


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * (x A^T) B^T: x [..., in], a [r, in], b [out, r] -> [..., out] (the reference every path must equal)."""
    return scale * ((x @ a.T) @ b.T)


class LoRASlots:
    """Adapter weights in `num_slots` fixed slots of rank `max_rank`, per target module: A as [S * R, in] and B^T as
    [S * R, out], slot s in rows [s * R, s * R + r) (an adapter of rank r < R is zero past r, which adds nothing). A
    module is allocated when the first adapter that changes it is loaded; a slot's scale (lora_alpha / r) is folded
    into its B rows, so a product over the first n slots is one GEMM each way over a view."""

    def __init__(
        self, shapes: dict[str, tuple[int, int]], num_slots: int, max_rank: int, dtype: torch.dtype, device
    ) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"LoRA slots need num_slots >= 1 and max_rank >= 1, got {num_slots} and {max_rank}")
        self.shapes = shapes  # module name -> (out, in): what an adapter may change
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.a: dict[str, torch.Tensor] = {}  # module -> [S * R, in]
        self.b_t: dict[str, torch.Tensor] = {}  # module -> [S * R, out], scale folded in

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Put an adapter in `slot`: module -> (A [r, in], B [out, r], scale); every other module's rows are zeroed."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside [0, {self.num_slots})")
        unknown = sorted(set(weights) - set(self.shapes))
        if unknown:
            raise ValueError(f"LoRA weights for modules {unknown[:3]} that take no adapter")
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for name in self.a:
            if name not in weights:
                self.a[name][rows] = 0
                self.b_t[name][rows] = 0
        for name, (a, b, scale) in weights.items():
            out_features, in_features = self.shapes[name]
            rank = a.shape[0]
            if a.shape != (rank, in_features) or b.shape != (out_features, rank) or rank > self.max_rank:
                raise ValueError(
                    f"{name}: A {list(a.shape)} / B {list(b.shape)} do not fit ({out_features}, {in_features}) at "
                    f"rank <= {self.max_rank}"
                )
            if name not in self.a:
                size = self.num_slots * self.max_rank
                self.a[name] = torch.zeros(size, in_features, dtype=self.dtype, device=self.device)
                self.b_t[name] = torch.zeros(size, out_features, dtype=self.dtype, device=self.device)
            a_rows, b_rows = self.a[name][rows], self.b_t[name][rows]
            a_rows.zero_()
            b_rows.zero_()
            a_rows[:rank] = a.to(self.dtype)
            # scaled in float32 (or the slot's wider dtype) before the cast: a bf16 slot rounds the product once
            wide = torch.promote_types(self.dtype, torch.float32)
            b_rows[:rank] = (b.to(wide).T * scale).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b_t.values()))


@dataclass(frozen=True)
class LoRARun:
    """Rows [start, end) of a batch that run with the adapter in `slot`, its product times `scale`."""

    start: int
    end: int
    slot: int
    scale: float


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter each row of one forward runs with: the part of ForwardContext that LoRA hooks read. Rows in no run
    get the base model's outputs."""

    slots: LoRASlots  # the engine's stacked adapters (owned by the caller, like the KV cache)
    runs: tuple[LoRARun, ...]  # consecutive rows sharing an adapter (a request's tokens are consecutive)
    num_rows: int  # T: rows of the forward
    # [T, n * R]: each row's scale on its own slot's columns and 0 elsewhere, n = the highest slot in use + 1: the mask
    # of the one product over the stacked slots; None when the runs are few enough to take one product each
    row_scales: torch.Tensor | None = None

    @classmethod
    def of(
        cls, slots: LoRASlots, runs: tuple[LoRARun, ...], num_rows: int, stacked: bool | None = None
    ) -> LoRAMapping | None:
        """The mapping of a forward of `num_rows` rows; None when no run has an adapter (a base-only batch).
        `stacked`: one masked product over the slots (True) or one product per run (False); None: by the run count."""
        runs = tuple(r for r in runs if r.end > r.start)
        if not runs:
            return None
        for run in runs:
            if not (0 <= run.start < run.end <= num_rows and 0 <= run.slot < slots.num_slots):
                raise ValueError(f"{run} does not fit {num_rows} rows and {slots.num_slots} slots")
        if not (len(runs) > MAX_SEGMENT_RUNS if stacked is None else stacked):
            return cls(slots, runs, num_rows)
        rank = slots.max_rank
        used = max(r.slot for r in runs) + 1
        scales = torch.zeros(num_rows, used * rank, dtype=slots.dtype, device=slots.device)
        for run in runs:
            scales[run.start : run.end, run.slot * rank : (run.slot + 1) * rank] = run.scale
        return cls(slots, runs, num_rows, scales)

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out], the base output of module `name` on rows x [T, in], plus each row's adapter product."""
        a = self.slots.a.get(name)
        if a is None:  # no loaded adapter changes this module
            return y
        if x.shape[0] != self.num_rows:
            raise RuntimeError(f"the LoRA mapping covers {self.num_rows} rows, the forward {x.shape[0]}")
        b_t = self.slots.b_t[name]
        x = x.to(a.dtype)
        if self.row_scales is not None:
            width = self.row_scales.shape[1]
            xa = (x @ a[:width].T).mul_(self.row_scales)  # [T, n * R]: only each row's own slot survives
            if y.dtype == xa.dtype:
                return torch.addmm(y, xa, b_t[:width])
            return y + (xa @ b_t[:width]).to(y.dtype)
        y = y.clone()  # the base layer's output stays as it gave it
        rank = self.slots.max_rank
        for run in self.runs:
            rows, cols = slice(run.start, run.end), slice(run.slot * rank, (run.slot + 1) * rank)
            if y.dtype == a.dtype:
                y[rows].addmm_(x[rows] @ a[cols].T, b_t[cols], alpha=run.scale)
            else:
                y[rows] += (run.scale * ((x[rows] @ a[cols].T) @ b_t[cols])).to(y.dtype)
        return y


def install_lora_hooks(model: nn.Module) -> int:
    """Give every target linear of `model` (lora_target_shapes) the hook that adds the forward context's adapter
    products; idempotent (a model shared by engines gets one hook per linear). Returns how many linears have one."""
    from leanlm.model.context import current_lora  # the context imports this module's types

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        mapping = current_lora()
        return None if mapping is None else mapping.apply(module.lora_name, inputs[0], output)

    names = lora_target_shapes(model.config)
    for name in names:
        module = model.get_submodule(name)
        if getattr(module, "lora_name", None) is None:
            module.lora_name = name  # which slots' weights its hook reads
            module.register_forward_hook(hook)
    return len(names)
