"""The experts of one MoE layer run as one grouped product over the routed rows sorted by expert (llama.cpp's
mul_mat_id, vLLM's fused_moe: rows grouped per expert, one call with per-expert offsets).

The per-expert modules (`block.experts[e]`, HF's names) own the weights: compression, sharding, expert parallelism and
checkpoints walk them as before. The grouped forms below are caches built from them on first use and rebuilt when a
snapshot of the experts' modules and tensors no longer matches (a compression swap, a cast, an in-place edit). Paths,
the first that applies:
- native: float32 CPU rows whose experts all have a float32 native call (float32, GGUF int4 / int8 codes and the
  other AVX2 formats): one C call runs every expert's SwiGLU over its rows (decode_layers_f32.c);
- stacked: float experts (`Linear`) on an accelerator, weights stacked [E, N, K] (StackedLinear): one torch.bmm per
  projection over the rows padded per expert, when every expert has rows and padding at most doubles them;
- per expert: each expert's module over its rows (autograd, hooks, remote experts, every other case).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.kernels import cpu_qgemv_avx2
from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeLinear, _Linear
from leanlm.kernels.spec import MIN_PARALLEL_BYTES
from leanlm.model.layers import Linear
from leanlm.model.linear.act_quant import current_activation_quant
from leanlm.model.linear.stack import StackedLinear

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    Path(__file__).parents[1] / "kernels" / "decode_layers_f32.c",
    "leanlm_moe_experts_f32",
    [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT],
    _INT,
    cpu_needs=(),
    level="avx2",
)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class NativeExperts:
    """Every expert's (gate, up, down) as the C grouped call runs them."""

    linears: tuple[NativeLinear, ...]  # [E * 3]: gate, up, down of each expert (they keep the tensors alive)
    structs: ctypes.Array  # the same as the C structs [E * 3] (pointers into the experts' tensors)
    hidden: int
    intermediate: int
    max_rows: int  # rows per expert the few-row kernels take: 16, or 64 where every one is float32 or int8-input

    @classmethod
    def of(cls, experts: nn.ModuleList) -> NativeExperts | None:
        """None where an expert is not a SwiGLU of linears with float32 native calls of one shape."""
        linears = []
        for expert in experts:
            for name in PROJECTIONS:
                make = getattr(getattr(expert, name, None), "native_linear_f32", None)
                lin = None if make is None else make()
                if lin is None or not lin.is_supported():
                    return None
                linears.append(lin)
        gate, down = linears[0], linears[2]
        shapes = {(lin.out_features, lin.in_features) for lin in linears}
        if getattr(experts[0], "hidden_act", "silu") != "silu" or shapes != {
            (gate.out_features, gate.in_features),
            (down.out_features, down.in_features),
        }:
            return None
        wide = all(lin.name == "f32" or lin.name.endswith("a8_f32") for lin in linears)
        structs = (_Linear * len(linears))(*[lin.to_struct() for lin in linears])
        rows = cpu_qgemv_avx2.MAX_ROWS_A8 if wide else cpu_qgemv_avx2.MAX_ROWS
        return cls(tuple(linears), structs, gate.in_features, gate.out_features, rows)

    def __call__(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """rows [A, hidden] float32 sorted by expert, offsets [E + 1] int64 -> [A, hidden]."""
        y = torch.empty_like(rows)
        num_experts = len(self.linears) // 3
        rc = _KERNEL.fn()(self.structs, num_experts, rows.data_ptr(), offsets.data_ptr(), y.data_ptr(),
                          self.hidden, self.intermediate, MIN_PARALLEL_BYTES, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"the grouped expert kernel failed (code {rc})")
        return y


def stacked_experts(experts: nn.ModuleList) -> tuple[StackedLinear, ...] | None:
    """(gate, up, down) of float experts stacked [E, N, K] (StackedLinear), each expert's weight then a view of its
    stack (so the stack costs no second copy of the weights); None where an expert is not three `Linear`s of one
    shape and dtype without bias."""
    layers = [[getattr(e, name, None) for e in experts] for name in PROJECTIONS]
    if any(type(lin) is not Linear or lin.bias is not None or lin.weight.is_meta for row in layers for lin in row):
        return None
    if any(getattr(e, "hidden_act", "silu") != "silu" for e in experts):
        return None
    try:
        stacks = tuple(Linear.stack(row) for row in layers)
    except ValueError:  # experts of different shapes or dtypes
        return None
    with torch.no_grad():
        for row, stack in zip(layers, stacks):
            for e, lin in enumerate(row):
                lin.weight.data = stack.tensors["weight"][e]
    return stacks


def stacked_forward(stacks: tuple[StackedLinear, ...], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows [A, hidden] sorted by expert (counts[e] of expert e, every one > 0) through their experts: rows padded
    to [E, n, hidden] (n the largest count), one bmm per projection, the padding dropped: [A, hidden]."""
    num_experts, width = len(counts), max(counts)
    counts_t = torch.tensor(counts, device=rows.device)
    slot = torch.arange(width, device=rows.device).expand(num_experts, width) < counts_t[:, None]  # [E, n]
    padded = rows.new_zeros(num_experts, width, rows.shape[1])
    padded[slot] = rows  # boolean-mask order is expert-major, row order within: the rows' own order
    gate, up, down = (s.tensors["weight"].to(rows.dtype) for s in stacks)  # [E, I, H], [E, I, H], [E, H, I]
    h = F.silu(torch.bmm(padded, gate.transpose(1, 2))) * torch.bmm(padded, up.transpose(1, 2))  # [E, n, I]
    return torch.bmm(h, down.transpose(1, 2))[slot]  # [A, hidden]


def per_expert_forward(experts: nn.ModuleList, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows [A, hidden] sorted by expert through each expert's own module, one call per expert: [A, hidden]."""
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = experts[e](rows[start : start + n])
        start += n
    return out


class GroupedExperts:
    """The grouped forms of one block's experts (see the module doc), made on first use, dropped when the experts'
    snapshot changes. Not a module: it holds no weights of its own and nothing of it is saved (a copy starts empty)."""

    def __init__(self) -> None:
        self._snapshot = None  # native_decode.ModuleSnapshot of the experts the forms below were made from
        self._modules: list[nn.Module] = []
        self._mode = ""  # the activation mode the forms were made in (leanlm.model.linear.act_quant)
        self._native: NativeExperts | None = None
        self._stacks: tuple[StackedLinear, ...] | None = None
        self._tried: set[str] = set()  # the forms tried since the snapshot ("native", "stacked")

    def __deepcopy__(self, memo) -> GroupedExperts:
        return GroupedExperts()

    def __getstate__(self) -> dict:
        return GroupedExperts().__dict__

    def forward(self, experts: nn.ModuleList, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [A, hidden] sorted by expert (counts[e] rows of expert e) through their experts: [A, hidden]."""
        if rows.shape[0] and self._may_group(experts, rows):
            if rows.dtype is torch.float32 and rows.is_cpu and rows.is_contiguous():
                native = self._form(experts, "native")
                if native is not None and max(counts) <= native.max_rows:
                    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
                    return native(rows, offsets)
            # off the CPU (a GPU's batched GEMM): on CPUs the per-expert products past the native kernels' rows are
            # GEMMs long enough that one call per expert costs nothing, and bf16 ones keep the native loop's bits
            if not rows.is_cpu and min(counts) > 0 and len(counts) * max(counts) <= 2 * rows.shape[0]:
                stacks = self._form(experts, "stacked")
                if stacks is not None and stacks[0].tensors["weight"].device == rows.device:
                    return stacked_forward(stacks, rows, counts)
        return per_expert_forward(experts, rows, counts)

    def _may_group(self, experts: nn.ModuleList, rows: torch.Tensor) -> bool:
        """No autograd to record and no hooks to call (calibration observers, LoRA): the grouped forms skip the
        experts' own forward calls."""
        if torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in experts.parameters())):
            return False
        from torch.nn.modules import module as torch_module

        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        self._check(experts)
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self._modules)

    def _check(self, experts: nn.ModuleList) -> None:
        if self._snapshot is None or not self._snapshot.is_current() or self._mode != current_activation_quant():
            self._reset(experts)

    def _reset(self, experts: nn.ModuleList) -> None:
        from leanlm.model.native_decode import ModuleSnapshot  # (native_decode imports moe, which imports this)

        self._modules = list(experts.modules())
        self._snapshot = ModuleSnapshot(self._modules)
        self._mode = current_activation_quant()  # a layer's kernels follow the step's activation mode too
        self._native, self._stacks, self._tried = None, None, set()

    def _form(self, experts: nn.ModuleList, kind: str):
        if kind not in self._tried:
            if kind == "native":
                self._native = NativeExperts.of(experts)
            else:
                stacks = stacked_experts(experts)
                if stacks is not None:  # the experts' weights are views of the stacks now: a new snapshot (and
                    self._reset(experts)  # native calls pointing at the new storage, when next asked for)
                self._stacks = stacks
            self._tried.add(kind)
        return self._native if kind == "native" else self._stacks
