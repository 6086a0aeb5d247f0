"""The native decode loop (kernels/cpu_decode.py) as a model uses it, and how it stays true to the model.

The loop holds raw pointers into the weights it was built from. A `NativeDecodePlan` therefore remembers what
it read (a `ModuleSnapshot`: each module, parameter and buffer by identity, each tensor's storage and version),
and the model rebuilds the plan whenever the snapshot no longer matches: a dtype cast, a module swapped by
compression, weights edited in place. The KV cache comes with each forward; the plan rebinds when it changes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from leanlm.kernels import cpu_decode, paged_attention
from leanlm.model.context import ForwardContext
from leanlm.model.paged_kv import PagedKVCache


def _tensor_version(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.is_inference() else t._version


class ModuleSnapshot:
    """What some modules hold now: their children, parameters and buffers by identity, and each tensor's data
    pointer (a dtype cast swaps `.data` in place) and version counter (in-place edits bump it)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        entries = []
        for module in modules:
            for held in (module._parameters, module._buffers):
                for name, t in held.items():
                    entries.append((held, name, t, None if t is None else t.data_ptr(), _tensor_version(t)))
            for name, child in module._modules.items():
                entries.append((module._modules, name, child, None, None))
        self._entries = entries

    def is_current(self) -> bool:
        for held, name, obj, data_ptr, version in self._entries:
            if held.get(name) is not obj:
                return False
            if data_ptr is not None and (obj.data_ptr() != data_ptr or _tensor_version(obj) != version):
                return False
        return True


def _modules_read(model: nn.Module) -> list[nn.Module]:
    """Every module whose tensors or children the plan reads (the model, its layers, their linears and norms)."""
    modules = [model, model.model, model.model.layers, model.model.norm, model.model.embed_tokens]
    if model.rotary_emb is not None:
        modules.append(model.rotary_emb)
    for layer in model.model.layers:
        modules += [layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        modules += list(layer.self_attn.children()) + list(layer.mlp.children())
    return modules


def _build_loop(model: nn.Module) -> cpu_decode.DecodeLayers | None:
    """The loop over every layer, when each piece is on a path it has: the native attention backend, bf16 norms
    and embeddings, and linears that are bf16, int8 weight-only or group-wise int2-4."""
    layers, rotary, cfg = model.model.layers, model.rotary_emb, model.config
    norm = model.model.norm.weight
    if (
        not len(layers) or rotary is None or layers[0].self_attn.backend.name != "cpu" or not cpu_decode.is_available()
        or norm.dtype != torch.bfloat16 or not norm.is_cpu or not norm.is_contiguous()
        or model.model.embed_tokens.weight.dtype != torch.bfloat16
        or rotary.cos.dtype != torch.float32 or not rotary.cos.is_cpu
        or not paged_attention.supports_heads(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    ):  # fmt: skip
        return None
    native: list[cpu_decode.NativeLayer] = []
    for layer in layers:
        modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
        specs = tuple(getattr(modules[n], "native_linear", lambda: None)() for n in cpu_decode.LINEAR_ORDER)
        if any(s is None for s in specs):
            return None
        spec = cpu_decode.NativeLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, specs)
        if not spec.is_supported():
            return None
        native.append(spec)
    return cpu_decode.DecodeLayers(native, norm, rotary.cos, rotary.sin, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps)


class NativeDecodePlan:
    """The loop built from a model's current weights (None where it does not apply), and the snapshot that
    says whether it still matches them."""

    def __init__(self, model: nn.Module) -> None:
        self.snapshot = ModuleSnapshot(_modules_read(model))
        self.loop = _build_loop(model)
        self._layer_ids = [layer.self_attn.layer_idx for layer in model.model.layers]
        # The cache the loop points into, held weakly (a discarded engine's cache must be freed): the loop runs
        # only on the cache of the forward at hand, so a dead one is never read.
        self._bound: weakref.ref[PagedKVCache] | None = None
        self._bound_ok = False

    def is_current(self) -> bool:
        return self.snapshot.is_current()

    def accepts(self, cache: PagedKVCache) -> bool:
        """Whether the loop runs on `cache` (it then points into it): a bf16 or int8 CPU cache covering every
        layer of the model."""
        if self.loop is None:
            return False
        if self._bound is None or self._bound() is not cache:
            covers = cache.first_layer <= min(self._layer_ids) and max(self._layer_ids) < (
                cache.first_layer + cache.num_layers)
            self._bound_ok = covers and self.loop.bind_kv([cache.layer(i) for i in self._layer_ids])
            self._bound = weakref.ref(cache)
        return self._bound_ok

    def run(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Final-normed hidden [M, hidden] for an all-decode batch of embeddings x [M, hidden] (overwritten), or
        None when the loop cannot take this model or this forward's cache."""
        if not self.accepts(ctx.kv_cache):
            return None
        return self.loop(x, positions, ctx.slot_mapping, ctx.decode_block_tables, ctx.decode_seq_lens,
                         ctx.decode_max_seq_len)
