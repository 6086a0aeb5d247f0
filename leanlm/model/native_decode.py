"""The native decode loop (kernels/cpu_decode.py) as a model uses it, and how it stays true to the model.

The loop holds raw pointers into the weights it was built from. A `NativeDecodePlan` therefore remembers what
it read (a `ModuleSnapshot`: each module, parameter and buffer by identity, each tensor's storage and version),
and the model rebuilds the plan whenever the snapshot no longer matches: a dtype cast, a module swapped by
compression, weights edited in place. The KV cache comes with each forward; the plan rebinds when it changes.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from leanlm.kernels import cpu_decode, paged_attention
from leanlm.model.attention_pattern import layer_pattern
from leanlm.model.context import ForwardContext
from leanlm.model.linear.act_quant import activation_quant, current_activation_quant
from leanlm.model.moe import Router, SparseMoeBlock
from leanlm.model.paged_kv import PagedKVCache

logger = logging.getLogger(__name__)


class ModuleSnapshot:
    """What some modules hold now: their children, parameters and buffers by identity, and each tensor's data
    pointer (a dtype cast swaps `.data` in place) and version counter (in-place edits bump it). Checked before
    every native decode step, so the check runs as C-level maps (about 0.1 ms for SmolLM2's 850 entries)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._holders: list[dict] = []  # the dicts an entry lives in (_parameters, _buffers, _modules)
        self._names: list[str] = []
        self._objects: list = []  # what each entry held (None included: a bias added later is a change)
        for module in modules:
            for held in (module._parameters, module._buffers, module._modules):
                for name, obj in held.items():
                    self._holders.append(held)
                    self._names.append(name)
                    self._objects.append(obj)
        self._tensors = [t for t in self._objects if isinstance(t, torch.Tensor)]
        self._data_ptrs = list(map(torch.Tensor.data_ptr, self._tensors))
        # Inference tensors keep no version counter (and cannot be edited outside inference mode).
        self._versioned = [t for t in self._tensors if not t.is_inference()]
        self._versions = list(map(_VERSION, self._versioned))

    def is_current(self) -> bool:
        return (
            all(map(operator.is_, map(dict.get, self._holders, self._names), self._objects))
            and list(map(torch.Tensor.data_ptr, self._tensors)) == self._data_ptrs
            and list(map(_VERSION, self._versioned)) == self._versions
        )


_VERSION = operator.attrgetter("_version")


def _modules_read(model: nn.Module) -> list[nn.Module]:
    """Every module whose tensors or children the plan reads (the model, its layers, their linears and norms)."""
    modules = [model, model.model, model.model.layers, model.model.norm, model.model.embed_tokens]
    if model.rotary_emb is not None:
        modules.append(model.rotary_emb)
    for layer in model.model.layers:
        modules += [layer, layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm]
        modules += list(layer.self_attn.children()) + list(layer.mlp.modules())  # a MoE's experts and their linears
    return modules


def _is_plain_block(cfg) -> bool:
    """The block the native loop computes: Llama's (pre-norms, SiLU gate, full rotary, 1/sqrt(D) scale, no q/k norm,
    no clamp, no soft-cap, one rope base)."""
    return (
        cfg.arch.is_llama_block
        and cfg.hidden_act == "silu"
        and cfg.clip_qkv is None
        and cfg.rotary_dim is None
        and cfg.rope_local_theta is None
        and cfg.attn_logit_softcapping is None
        and cfg.query_pre_attn_scalar in (None, cfg.head_dim)
        and cfg.mla is None
    )


def _build_loop(model: nn.Module, packed: bool) -> cpu_decode.DecodeLayers | None:
    """The loop over every layer, when each piece is on a path it has: the native attention backend, bf16 norms
    and embeddings, and linears that are bf16, int8 weight-only, group-wise int2-4, W8A8 or 2:4 sparse, mixed
    freely. With `packed`, every linear brings its packed weight (packing it now if it has not yet), so the loop
    takes any number of rows."""
    layers, rotary, cfg = model.model.layers, model.rotary_emb, model.config
    norm = model.model.norm.weight
    dtype = norm.dtype  # the activations': bf16 (AVX512 loop) or float32 (AVX2 loop: 16 rows, 64 on some formats)
    if (
        not len(layers)
        or not _is_plain_block(cfg)
        or rotary is None
        or layers[0].self_attn.backend.name != "cpu"
        or not cpu_decode.is_available(dtype)
        or (dtype is torch.float32 and packed)
        or not norm.is_cpu
        or not norm.is_contiguous()
        or model.model.embed_tokens.weight.dtype != dtype
        or rotary.cos.dtype != torch.float32
        or not rotary.cos.is_cpu
        or not paged_attention.supports_heads(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    ):
        return None
    native: list[cpu_decode.NativeLayer] = []
    for layer in layers:
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        moe = _native_moe(layer.mlp, packed, dtype) if sparse else None
        mlp = layer.mlp.experts[0] if moe is not None else layer.mlp
        modules = {**dict(layer.self_attn.named_children()), **dict(mlp.named_children())}
        specs = tuple(_native_linear(modules.get(n), packed, dtype) for n in cpu_decode.LINEAR_ORDER)
        if any(s is None or (packed and s.many_rows is None) for s in specs):
            return None
        if isinstance(layer.mlp, SparseMoeBlock) and moe is None:
            return None
        spec = cpu_decode.NativeLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, specs, moe)
        if not spec.is_supported(dtype):
            return None
        native.append(spec)
    try:
        return cpu_decode.DecodeLayers(
            native,
            norm,
            rotary.cos,
            rotary.sin,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            dtype,
        )
    except ValueError as e:  # a layer the loop cannot size (the loaders refuse such checkpoints first)
        logger.warning("native decode loop off: %s", e)
        return None


def _native_mlp(mlp: nn.Module, packed: bool, dtype: torch.dtype) -> tuple | None:
    """(gate, up, down) of a SwiGLU MLP as the loop runs them; None where one has no native path."""
    specs = tuple(_native_linear(getattr(mlp, n, None), packed, dtype) for n in ("gate_proj", "up_proj", "down_proj"))
    return None if any(s is None or (packed and s.many_rows is None) for s in specs) else specs


def _native_moe(block: SparseMoeBlock, packed: bool, dtype: torch.dtype) -> cpu_decode.NativeMoE | None:
    """The block as the loop runs it; None where it cannot: a gated shared expert, or an expert off the kernels. The
    loop counts its routing into the block's own counters."""
    if block.shared_expert_gate is not None or not isinstance(block.gate, Router) or not block.moe.is_plain:
        return None
    experts = tuple(_native_mlp(e, packed, dtype) for e in block.experts)
    shared = None if block.shared_expert is None else _native_mlp(block.shared_expert, packed, dtype)
    if any(e is None for e in experts) or (block.shared_expert is not None and shared is None):
        return None
    router = block.gate.weight.detach()
    return cpu_decode.NativeMoE(router, block.moe.top_k, block.moe.scoring, experts, shared, block.stats.native)


def _native_linear(
    module: nn.Module, packed: bool, dtype: torch.dtype = torch.bfloat16
) -> cpu_decode.NativeLinear | None:
    if dtype is torch.float32:
        native_linear_f32 = getattr(module, "native_linear_f32", None)
        return None if native_linear_f32 is None else native_linear_f32()
    native_linear = getattr(module, "native_linear", None)
    return None if native_linear is None else native_linear(packed=packed)


class _BoundLoop:
    """A loop and the KV cache it points into, held weakly (a discarded engine's cache must be freed): the
    loop runs only on the cache of the forward at hand, so a dead one is never read."""

    def __init__(self, loop: cpu_decode.DecodeLayers | None, layer_ids: list[int]) -> None:
        self.loop, self._layer_ids = loop, layer_ids
        self._bound: weakref.ref[PagedKVCache] | None = None
        self._bound_ok = False

    def accepts(self, cache: PagedKVCache) -> bool:
        """Whether the loop runs on `cache` (it then points into it): a bf16 or int8 CPU cache covering every
        layer of the model."""
        if self.loop is None:
            return False
        if self._bound is None or self._bound() is not cache:
            ids = self._layer_ids
            covers = cache.first_layer <= min(ids) and max(ids) < cache.first_layer + cache.num_layers
            self._bound_ok = covers and self.loop.bind_kv([cache.layer(i) for i in ids])
            self._bound = weakref.ref(cache)
        return self._bound_ok


class NativeDecodePlan:
    """The loops built from a model's current weights (None where they do not apply), and the snapshot that
    says whether they still match them: one on the linears' own weights for up to MAX_ROWS tokens, and one
    on their packed copies for more, built at the first such step (a model that only ever decodes a few
    requests at a time never pays the packed copies' memory)."""

    def __init__(self, model: nn.Module) -> None:
        self.snapshot = ModuleSnapshot(_modules_read(model))
        self._model = weakref.ref(model)  # the plan lives on the model: no cycle
        self._layer_ids = [layer.self_attn.layer_idx for layer in model.model.layers]
        self._windows = [layer.self_attn.window for layer in model.model.layers]  # trained sliding windows
        self._has_windows = any(w is not None for w in self._windows)
        self._moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.act_quant = current_activation_quant()  # the layers' calls are this mode's: a later loop is built in it
        self._few = _BoundLoop(_build_loop(model, packed=False), self._layer_ids)
        self._many: _BoundLoop | None = None

    @property
    def loop(self) -> cpu_decode.DecodeLayers | None:
        """The loop for up to MAX_ROWS tokens (None: this model has no native path)."""
        return self._few.loop

    @property
    def batched_loop(self) -> cpu_decode.DecodeLayers | None:
        """The loop for more tokens, once a step has needed it (None before, or where packing is unavailable)."""
        return None if self._many is None else self._many.loop

    def is_current(self) -> bool:
        return self.snapshot.is_current()

    def accepts(self, cache: PagedKVCache) -> bool:
        return self._few.accepts(cache)

    def _for_rows(self, rows: int) -> _BoundLoop:
        if self._few.loop is None or rows <= max(cpu_decode.MAX_ROWS, self._few.loop.max_rows or 0):
            return self._few
        if self._many is None:
            with activation_quant(self.act_quant):
                self._many = _BoundLoop(_build_loop(self._model(), packed=True), self._layer_ids)
        return self._many

    def run(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Final-normed hidden [M, hidden] for an all-decode batch of embeddings x [M, hidden] (overwritten), or
        None when no loop takes this model, this many rows or this forward's cache."""
        if ctx.lora is not None:
            return None  # the loop runs plain layers: adapter products run on the PyTorch path
        if self._moe_blocks and not ctx.routing.is_plain:
            return None  # pinned experts and capacities route on the PyTorch path
        bound = self._for_rows(x.shape[0])
        if not bound.accepts(ctx.kv_cache) or x.shape[0] > (bound.loop.max_rows or x.shape[0]):
            return None
        bounds = self._layer_bounds(ctx)
        if bound.loop.dtype is torch.float32 and (bounds is not None or ctx.long_inputs.sink_positions is not None):
            return None  # the float32 loop reads every key: windows and sinks stay on the PyTorch path
        return bound.loop(
            x,
            positions,
            ctx.slot_mapping,
            ctx.decode_block_tables,
            ctx.decode_seq_lens,
            ctx.decode_max_seq_len,
            bounds,
            ctx.long_inputs.sink_positions,
        )

    def _layer_bounds(self, ctx: ForwardContext) -> torch.Tensor | None:
        """[L, M, 3] long: each layer's (lo, sinks, stride) per decode row; None when every layer reads every key."""
        if ctx.long_inputs.patterns.decode is None and not self._has_windows:  # every step of a full-attention model
            return None
        patterns = [layer_pattern(ctx.long_inputs.patterns.decode, w) for w in self._windows]
        rows = ctx.decode_seq_lens.shape[0]
        full = torch.zeros(rows, 3, dtype=torch.long)  # lo 0: every key
        per_layer = [ctx.decode_bounds(p) for p in patterns]
        return torch.stack([full if b is None else b for b in per_layer])
