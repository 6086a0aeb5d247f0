"""Weight offloading (FlexGen, Sheng et al. 2023; llama.cpp's partial offload): the decoder layers that do not fit a
byte budget leave the resident set and stream back in as they run, one at a time, the next layer's load overlapping
the current layer's compute. On CPU they live in a memory-mapped safetensors file whose pages are mapped in before
a layer runs and out after; on a GPU, in pinned host memory copied on a side CUDA stream (model/layer_store.py)."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
from torch import nn

from leanlm.model.layer_store import LayerStore, Pending, make_store, tensor_nbytes
from leanlm.model.packed_cache import PackedCache

logger = logging.getLogger(__name__)

WINDOW_LAYERS = 2  # streamed layers materialized at once: the one running and the one being prefetched


def weight_bytes(tensors) -> int:
    """Bytes of the distinct materialized tensors among `tensors` (shared storage counted once, meta skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor_nbytes(t)
    return total


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


@dataclass(frozen=True)
class OffloadPlan:
    """Which decoder layers stay resident under a weight budget and which stream, and the bytes of each part."""

    max_weight_memory: int  # the budget: resident weights + the streaming window never exceed it
    fixed_bytes: int  # embeddings, final norm, head (and exits): always resident
    layer_bytes: tuple[int, ...]  # each decoder layer's weight bytes, by layer index
    streamed_idx: tuple[int, ...]  # layers that stream, increasing; () when everything fits

    @property
    def resident_idx(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.layer_bytes)) if i not in self.streamed_idx)

    @property
    def resident_bytes(self) -> int:
        return self.fixed_bytes + sum(self.layer_bytes[i] for i in self.resident_idx)

    @property
    def window_bytes(self) -> int:
        """The most bytes the streamed layers hold at once: the largest WINDOW_LAYERS of them."""
        return sum(sorted((self.layer_bytes[i] for i in self.streamed_idx), reverse=True)[:WINDOW_LAYERS])

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.window_bytes


def plan_offload(model: nn.Module, max_weight_memory: int) -> OffloadPlan:
    """Keep as many decoder layers resident as fit beside the fixed parts and a window of WINDOW_LAYERS streamed
    layers, in the order first, last, then second, third, ... (so the streamed layers are one contiguous run).
    ValueError naming the minimum budget when even the fixed parts and the window do not fit."""
    layers = model.model.layers
    layer_bytes = tuple(weight_bytes(module_tensors(layer)) for layer in layers)
    in_layers = {id(t) for layer in layers for t in module_tensors(layer)}
    fixed = weight_bytes(t for t in module_tensors(model) if id(t) not in in_layers)
    total = fixed + sum(layer_bytes)
    if total <= max_weight_memory:
        return OffloadPlan(max_weight_memory, fixed, layer_bytes, ())
    count = len(layer_bytes)
    order = [0, count - 1, *range(1, count - 1)] if count > 1 else [0]
    minimum = fixed + sum(sorted(layer_bytes, reverse=True)[:WINDOW_LAYERS])
    if max_weight_memory < minimum:
        raise ValueError(
            f"max_weight_memory={max_weight_memory:,} bytes cannot hold the embeddings, norms and head "
            f"({fixed:,} bytes) plus a window of {WINDOW_LAYERS} streamed decoder layers "
            f"({minimum - fixed:,} bytes): give at least {minimum:,} bytes ({minimum / 1e9:.2f} GB); "
            f"the whole model is {total:,} bytes"
        )
    resident: list[int] = []
    for i in order:
        streamed = tuple(j for j in range(count) if j not in resident and j != i)
        plan = OffloadPlan(max_weight_memory, fixed, layer_bytes, streamed)
        if plan.peak_bytes > max_weight_memory:
            break
        resident.append(i)
    return OffloadPlan(max_weight_memory, fixed, layer_bytes, tuple(j for j in range(count) if j not in resident))


@dataclass(frozen=True)
class _Slot:
    """Where one of a layer's tensors lives: module._parameters[name] or module._buffers[name]."""

    key: str  # the tensor's name in the layer's store, relative to the layer
    module: nn.Module
    name: str
    is_parameter: bool


def _slots(layer: nn.Module) -> list[_Slot]:
    slots = []
    for prefix, module in layer.named_modules():
        for holder, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, t in holder.items():
                if t is not None:
                    slots.append(_Slot(f"{prefix}.{name}" if prefix else name, module, name, is_parameter))
    return slots


def _put(slot: _Slot, tensor: torch.Tensor) -> None:
    if slot.is_parameter:
        slot.module._parameters[slot.name] = nn.Parameter(tensor, requires_grad=False)
    else:
        slot.module._buffers[slot.name] = tensor


def _clear_derived(layer: nn.Module) -> None:
    """Drop every copy a layer's modules derived from their tensors (packed GEMM panels, dense copies): they hold
    the released tensors' storage and would keep the layer resident. Where one was dropped (a step of 9+ rows),
    its heap pages go back to the OS at once: glibc would keep them, and the next layer's copy would not reuse
    them all, so the resident set would grow by up to the model's size over one prefill."""
    caches = [v for module in layer.modules() for v in vars(module).values() if isinstance(v, PackedCache)]
    if any(c.value is not None for c in caches):
        for cache in caches:
            cache.clear()
        return_freed_memory()


class OffloadedLayers:
    """Streams a model's offloaded decoder layers through forward hooks on those layers: before layer i runs its
    tensors are put in place (from the prefetch started by the layer before, else read now) and the next streamed
    layer's read starts; after it runs they are replaced by meta placeholders. Layers run in any order stay
    correct (a layer that was not prefetched is read on the spot); in order, each read overlaps a layer's compute,
    and after the last streamed layer the first one's read overlaps the resident layers and the next step.

    Invariant: at most WINDOW_LAYERS streamed layers are materialized or being read at once, so the model's
    materialized weight bytes stay within plan.peak_bytes <= plan.max_weight_memory (`live_bytes` tracks them);
    beyond that only the running layer's derived copy (its packed GEMM panels, in a step of 9+ rows) exists.
    The native decode loop holds every layer's weight pointers at once, so it is turned off for the model.
    """

    def __init__(self, model: nn.Module, plan: OffloadPlan, store: LayerStore) -> None:
        self.plan, self.store = plan, store
        self._layers = {i: model.model.layers[i] for i in plan.streamed_idx}
        self._slots = {i: _slots(layer) for i, layer in self._layers.items()}
        self._next = {i: plan.streamed_idx[(k + 1) % len(plan.streamed_idx)] for k, i in enumerate(plan.streamed_idx)}
        self._materialized: set[int] = set()
        self._pending: tuple[int, Pending] | None = None
        self.live_bytes = 0  # bytes of streamed layers materialized or being read now
        self.peak_live_bytes = 0
        self.num_reads = self.num_prefetch_hits = 0
        for i, layer in self._layers.items():
            slots = self._slots[i]
            store.write(i, {s.key: getattr(s.module, s.name) for s in slots})
            _clear_derived(layer)
            self._release(i, force=True)
        self._hooks = []
        for i, layer in self._layers.items():
            self._hooks.append(layer.register_forward_pre_hook(self._make_before(i)))
            self._hooks.append(layer.register_forward_hook(self._make_after(i)))
        # A resident layer's packed GEMM copy (made at 9+ rows) would add up to its weight bytes again, outside the
        # budget: dropped after each run, so only the running layer's ever exists (re-packed the next such step).
        for i in plan.resident_idx:
            layer = model.model.layers[i]
            self._hooks.append(layer.register_forward_hook(lambda module, args, output: _clear_derived(module)))
        model.disable_native_decode()  # its plan would read every layer's weights at once

    def _make_before(self, idx: int):
        def before(module, args):
            self.acquire(idx)

        return before

    def _make_after(self, idx: int):
        def after(module, args, output):
            self.release(idx)

        return after

    # -- the window ------------------------------------------------------------------------------------

    def _start_read(self, idx: int) -> Pending:
        self.live_bytes += self.plan.layer_bytes[idx]
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        self.num_reads += 1
        return self.store.start(idx)

    def acquire(self, idx: int) -> None:
        """Layer idx's tensors in place, and the next streamed layer's read under way."""
        if idx not in self._materialized:
            for other in list(self._materialized):  # a layer whose forward raised is still in place
                self.release(other)
            pending = self._take_pending()
            if pending is not None and pending[0] == idx:
                tensors = pending[1].result()
                self.num_prefetch_hits += 1
            else:
                if pending is not None:  # a prefetch of another layer: finish it and let it go
                    pending[1].result()
                    self.store.free(pending[0])
                    self.live_bytes -= self.plan.layer_bytes[pending[0]]
                tensors = self._start_read(idx).result()
            for slot in self._slots[idx]:
                _put(slot, tensors[slot.key])
            self._materialized.add(idx)
        following = self._next[idx]
        if self._pending is None and following not in self._materialized:
            self._pending = (following, self._start_read(following))

    def _take_pending(self) -> tuple[int, Pending] | None:
        pending, self._pending = self._pending, None
        return pending

    def release(self, idx: int) -> None:
        if idx in self._materialized:
            self._release(idx)

    def _release(self, idx: int, force: bool = False) -> None:
        for slot in self._slots[idx]:
            t = getattr(slot.module, slot.name)
            _put(slot, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        _clear_derived(self._layers[idx])
        if not force:
            self.store.free(idx)
            self._materialized.discard(idx)
            self.live_bytes -= self.plan.layer_bytes[idx]

    def close(self) -> None:
        """Finish a read in flight and free the store (the layers stay offloaded: the model cannot run after)."""
        pending = self._take_pending()
        if pending is not None:
            pending[1].result()
        for hook in self._hooks:
            hook.remove()
        self.store.close()

    def describe(self) -> str:
        p = self.plan
        return (
            f"weight offloading: {len(p.streamed_idx)} of {len(p.layer_bytes)} decoder layers stream "
            f"(layers {p.streamed_idx[0]}-{p.streamed_idx[-1]}), {p.resident_bytes:,} bytes resident + a "
            f"{p.window_bytes:,}-byte window <= max_weight_memory {p.max_weight_memory:,}"
        )


def offload_layers(model: nn.Module, max_weight_memory: int, directory: str | None = None) -> OffloadedLayers | None:
    """Offload the decoder layers of `model` that do not fit `max_weight_memory` bytes (see plan_offload): None
    when every weight fits (nothing changes). `directory`: where the CPU store writes its files (default:
    $LEANLM_CACHE/offload; each is a private temp file, unlinked once mapped, so nothing is left behind)."""
    plan = plan_offload(model, max_weight_memory)
    if not plan.streamed_idx:
        return None
    device = next(model.parameters()).device  # a pipeline stage but the last holds no final norm
    offloaded = OffloadedLayers(model, plan, make_store(device, directory))
    return_freed_memory()
    logger.info(offloaded.describe())
    return offloaded


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps freed chunks below its mmap threshold, which grows to
    32 MiB, in the heap: without this the process's RSS would not shrink). No-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()
