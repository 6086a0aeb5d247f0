"""LoadSlice: what one rank of a parallel engine keeps of a checkpoint (its decoder layers, embedding and head, its
experts, its slice of every linear), handed to the one loader so that each tensor is cut as it is read and the
rest of the file is never copied (vLLM's per-rank loading). The cuts are those the runtime formats' shard() makes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from leanlm.model.linear.shard import COLUMN, ROW, check_axis, part

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Cut:
    """A linear's slice on this rank, as `layer.shard(axis, rank, world, sizes)` takes it."""

    axis: int  # COLUMN (rows of the weight [out, in]: out features) or ROW (columns: in features)
    rank: int  # the part this rank keeps
    world: int  # equal parts, or len(sizes)
    sizes: tuple[int, ...] | None = None  # uneven parts (attention heads split by KV group)

    def __post_init__(self) -> None:
        check_axis(self.axis)
        if not 0 <= self.rank < self.world:
            raise ValueError(f"a cut needs 0 <= rank < world, got rank={self.rank}, world={self.world}")
        if self.sizes is not None and len(self.sizes) != self.world:
            raise ValueError(f"a cut over {self.world} parts got {len(self.sizes)} sizes")

    def features(self, size: int, unit: int = 1) -> slice:
        """This rank's slice of `size` features along the axis (ValueError when it splits a block of `unit`)."""
        return part(size, self.axis, self.rank, self.world, unit, "sliced load", self.sizes)

    def weight(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's own copy of the slice of weight t [out, in] (a view would keep the whole tensor alive)."""
        cut = self.features(t.shape[self.axis])
        return (t[cut] if self.axis == COLUMN else t[:, cut]).clone()

    def bias(self, t: torch.Tensor) -> torch.Tensor | None:
        """The bias [out] this rank keeps: its rows (COLUMN), or all of it on the first rank only (ROW: the partial
        outputs are summed over the ranks, which must add it once)."""
        if self.axis == ROW:
            return t if self.rank == 0 else None
        return t[self.features(t.shape[0])].clone()


@dataclass(frozen=True)
class LoadSlice:
    """The part of a checkpoint a rank holds. Names are the model's HF names (`model.layers.3.self_attn.q_proj`)."""

    num_layers: int  # the whole model's decoder layers (checked against the checkpoint's config)
    layer_start: int  # the decoder layers [layer_start, layer_stop) this rank holds (its pipeline stage)
    layer_stop: int
    has_embedding: bool  # embed_tokens (the first stage)
    has_head: bool  # the final norm and lm_head (the last stage)
    cuts: Mapping[str, Cut] = field(default_factory=dict)  # module name -> its slice; absent: kept whole
    # experts [lo, hi) this rank holds in every MoE layer (expert parallelism); None: all of them
    experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_stop <= self.num_layers:
            raise ValueError(
                f"a load slice holds layers [{self.layer_start}, {self.layer_stop}) of {self.num_layers}: "
                "it needs 0 <= start < stop <= the model's layers"
            )
        if self.experts is not None and not 0 <= self.experts[0] < self.experts[1]:
            raise ValueError(f"a load slice's experts [{self.experts[0]}, {self.experts[1]}) hold none")

    def holds(self, name: str, tied: bool = False) -> bool:
        """Whether tensor `name` (model names) is part of this rank's model at all (`tied`: the head is the
        embedding's tensor, which the last stage then reads too)."""
        if m := _LAYER.match(name):
            if not self.layer_start <= int(m.group(1)) < self.layer_stop:
                return False
            e = _EXPERT.search(name)
            return self.experts is None or e is None or self.experts[0] <= int(e.group(1)) < self.experts[1]
        if name.startswith("model.embed_tokens."):
            return self.has_embedding or (tied and self.has_head)
        return self.has_head or not name.startswith(("model.norm.", "lm_head."))

    def cut_of(self, name: str) -> Cut | None:
        """The cut of tensor `name`'s module (`x.q_proj.weight` -> the cut of `x.q_proj`), None: whole."""
        return self.cuts.get(name.rsplit(".", 1)[0])

    def cut_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """Tensor `name` as this rank keeps it (a row-parallel bias off the first rank: None); whole if uncut."""
        cut = self.cut_of(name)
        if cut is None:
            return t
        return cut.bias(t) if name.endswith(".bias") else cut.weight(t)

    def check(self, num_layers: int, source: object) -> None:
        """A slice planned for another model's layer count is refused before anything is read."""
        if num_layers != self.num_layers:
            raise ValueError(
                f"{source}: the checkpoint has {num_layers} decoder layers, the rank's load slice was planned for "
                f"{self.num_layers}: the file changed since its config was read; load one checkpoint"
            )


def own(layer: nn.Module) -> nn.Module:
    """`layer` holding its own memory: a format's shard() may return views, which would keep the whole tensors
    alive (and the whole layer's bytes in the rank's memory)."""
    for module in layer.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, b.clone(), persistent=name not in module._non_persistent_buffers_set)
    return layer
