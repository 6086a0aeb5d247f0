"""One Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 via `attention_bias`) over flat token batches.

Module and weight names follow HF's LlamaForCausalLM, so HF state dicts load as they are.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.config import ModelConfig
from leanlm.kernels import cpu_decode, paged_attention
from leanlm.model.attention import AttentionBackend, get_backend
from leanlm.model.context import get_forward_context
from leanlm.model.kv_quant import is_quantized
from leanlm.model.layers import Linear, RMSNorm, RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.backend = backend
        # Bound by the model runner: this layer's slice of the paged cache, [num_blocks, Hkv, block_size, D].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An 8-bit cache's per-(token, KV head) scales, [num_blocks, Hkv, block_size] float32; None otherwise.
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache is not bound: the model runs through leanlm's ModelRunner")
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.backend.forward(
            q, k, v, self.k_cache, self.v_cache, self.scale, get_forward_context(), self.k_scales, self.v_scales
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_proj(x), self.up_proj(x)
        if cpu_decode.should_use_rows(gate) and up.is_contiguous():  # the native loop's arithmetic
            return self.down_proj(cpu_decode.silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


@dataclass(frozen=True)
class LinearGroup:
    """Linears of a layer that read the same input, and the op producing that input: the structure that
    SmoothQuant and AWQ fold per-channel scales along (y = producer(x) / s feeds W * s), declared as data."""

    producer: str  # submodule whose output is the group's input: a norm, or a linear
    linears: tuple[str, ...]  # submodule names, relative to the layer
    # the block whose output AWQ scores the group's scales on, fed by the group's input (AutoAWQ's
    # module2inspect): attention for q/k/v, the MLP for gate/up; "" = the group's one linear itself
    block: str = ""
    can_fold: bool = True  # False when producer's output channels do not map 1:1 to the inputs (GQA v -> o)

    def __post_init__(self) -> None:
        if not self.block:
            if len(self.linears) != 1:
                raise ValueError(f"a group of several linears {self.linears} must name the block they feed")
            object.__setattr__(self, "block", self.linears[0])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # v_proj's output channels reach o_proj one-to-one only without grouped-query attention.
        self.linear_groups = (
            LinearGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
            LinearGroup("self_attn.v_proj", ("self_attn.o_proj",),
                        can_fold=config.num_attention_heads == config.num_key_value_heads),
            LinearGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
            LinearGroup("mlp.up_proj", ("mlp.down_proj",)),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Every layer in one native call for all-decode steps of <= 8 tokens; set by LlamaForCausalLM.
        self.native_decode: cpu_decode.DecodeLayers | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.native_decode is not None and x.shape[0] <= cpu_decode.MAX_ROWS:
            ctx = get_forward_context()
            if ctx.is_all_decode:
                return self.native_decode(x, positions, ctx.slot_mapping, ctx.decode_block_tables,
                                          ctx.decode_seq_lens, ctx.decode_max_seq_len)  # fmt: skip
        rope = rotary(positions, x.dtype)  # cos, sin [T, 1, D/2], shared by every layer
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, hidden]; compute_logits(hidden [N, .]) -> [N, V]."""

    def __init__(self, config: ModelConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, get_backend(attention_backend))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb: RotaryEmbedding | None = None  # built on the real device by build_model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.rotary_emb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def bind_kv_cache(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Give each attention layer its (k_cache, v_cache), each [num_blocks, Hkv, block_size, D], and for an
        8-bit cache (int8/fp8) its (k_scales, v_scales), each [num_blocks, Hkv, block_size] float32."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        scales = kv_scales if kv_scales is not None else [(None, None)] * len(kv_caches)
        if len(scales) != len(kv_caches):
            raise ValueError(f"got {len(scales)} KV scale pairs for {len(kv_caches)} layers")
        for layer, (k_cache, v_cache), (k_scales, v_scales) in zip(self.model.layers, kv_caches, scales):
            if is_quantized(k_cache.dtype) != (k_scales is not None):
                raise ValueError(f"a {k_cache.dtype} KV cache needs scales exactly when it is 8-bit (int8/fp8)")
            attn = layer.self_attn
            attn.k_cache, attn.v_cache, attn.k_scales, attn.v_scales = k_cache, v_cache, k_scales, v_scales
        self.refresh_native_decode()

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """This model cut after `num_layers` decoder layers, then its final norm and head (the early-exit draft
        of self-speculation). Every module, and so every weight and bound KV cache, is shared: nothing is copied.
        """
        if not 1 <= num_layers < self.config.num_hidden_layers:
            raise ValueError(
                f"a draft of the first {num_layers} layers needs 1 <= layers < {self.config.num_hidden_layers}"
            )
        config = dataclasses.replace(self.config, num_hidden_layers=num_layers)
        with torch.device("meta"):
            draft = LlamaForCausalLM(config)
        draft.model.embed_tokens, draft.model.norm = self.model.embed_tokens, self.model.norm
        draft.model.layers = nn.ModuleList(self.model.layers[:num_layers])
        draft.lm_head, draft.rotary_emb = self.lm_head, self.rotary_emb
        draft.refresh_native_decode()
        return draft.eval()

    def refresh_native_decode(self) -> None:
        """(Re)bind the native decode loop to the current weights and KV cache, or drop it where it does not
        apply. The loop holds raw pointers: call this after replacing modules or weight tensors (compress()
        does) once a cache is bound."""
        self.model.native_decode = None
        self.model.native_decode = self._native_decode_layers()

    def _native_decode_layers(self) -> cpu_decode.DecodeLayers | None:
        """The loop over every layer, when each piece is on a path it has: the native attention backend on a
        bf16 or int8 cache, bf16 norms, and linears that are bf16, int8 weight-only or group-wise int2-4."""
        layers, rotary, cfg = self.model.layers, self.rotary_emb, self.config
        attn0 = layers[0].self_attn if len(layers) else None
        norm = self.model.norm.weight
        if (
            attn0 is None or rotary is None or attn0.backend.name != "cpu" or not cpu_decode.is_available()
            or norm.dtype != torch.bfloat16 or not norm.is_cpu or not norm.is_contiguous()
            or self.model.embed_tokens.weight.dtype != torch.bfloat16
            or rotary.cos.dtype != torch.float32 or not rotary.cos.is_cpu
            or not paged_attention.supports_heads(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        ):  # fmt: skip
            return None
        native: list[cpu_decode.NativeLayer] = []
        for layer in layers:
            attn = layer.self_attn
            modules = {**dict(attn.named_children()), **dict(layer.mlp.named_children())}
            specs = tuple(getattr(modules[n], "native_linear", lambda: None)() for n in cpu_decode.LINEAR_ORDER)
            if any(s is None for s in specs) or attn.k_cache is None or attn.v_cache is None:
                return None
            spec = cpu_decode.NativeLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, specs,
                                          attn.k_cache, attn.v_cache, attn.k_scales, attn.v_scales)  # fmt: skip
            if not spec.is_supported():
                return None
            native.append(spec)
        return cpu_decode.DecodeLayers(
            native, norm, rotary.cos, rotary.sin, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
        )  # fmt: skip


def build_model(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
    quantized: dict[str, nn.Module] | None = None,
) -> LlamaForCausalLM:
    """Instantiate without random init (meta device), then adopt `state_dict` (HF names) in `dtype`.

    `quantized` maps module names to prebuilt quantized layers (from a checkpoint's metadata; they provide
    `set_compute_dtype`), swapped in for those linears; their tensors are not in `state_dict`.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend)
    for name, layer in (quantized or {}).items():
        model.set_submodule(name, layer.to(device).set_compute_dtype(dtype))
    weights = {name: t.to(device=device, dtype=dtype) for name, t in state_dict.items()}
    if config.tie_word_embeddings:
        if "lm_head.weight" in weights:
            raise ValueError("tied-embedding model has an lm_head.weight tensor; set tie_word_embeddings=False")
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    prefixes = tuple(name + "." for name in quantized or {})
    expected = {k for k in model.state_dict() if not k.startswith(prefixes)}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {config.architecture} architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(weights, assign=True, strict=not quantized)
    model.rotary_emb = RotaryEmbedding(
        config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
    ).to(device)
    return model.eval().requires_grad_(False)
