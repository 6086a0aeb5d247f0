"""The one decoder every architecture runs (leanlm.config.architectures declares how each differs from Llama: norms,
q/k norms, embedding scale, activations, soft-caps, rotary), over flat token batches.

Module and weight names follow HF's, so HF state dicts load as they are (fused files are split on read).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from leanlm.config import ModelConfig
from leanlm.model.attention import AttentionBackend, get_backend
from leanlm.model.capped_attention import capped_attention
from leanlm.model.context import get_forward_context
from leanlm.model.exit_head import build_exits
from leanlm.model.kv_quant import store_kv
from leanlm.model.layers import Linear, RMSNorm, Rope, RotaryEmbedding, apply_rotary
from leanlm.model.linear.act_quant import current_activation_quant
from leanlm.model.linear_groups import LinearGroup, layer_groups, mlp_groups, mlp_norm_name  # noqa: F401 (API)
from leanlm.model.mla import LatentAttention
from leanlm.model.mlp import LlamaMLP
from leanlm.model.moe import SparseMoeBlock
from leanlm.model.native_decode import NativeDecodePlan


class LlamaAttention(nn.Module):
    """Self-attention of every architecture: q/k/v projections, the family's q/k norms and clamp, rotary (the
    sliding layers' own where the model has one), the paged backend, soft-capped scores where the config caps them."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer of the forward context's KV cache this attention reads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        # OLMoE: RMSNorm over the whole q and k projections (all heads at once); Qwen3, Gemma 3: over each head
        self.per_head_norm = config.qk_norm == "head"
        q_norm, k_norm = (self.head_dim, self.head_dim) if self.per_head_norm else (q_size, kv_size)
        offset = config.arch.norm_offset
        self.q_norm = RMSNorm(q_norm, config.rms_norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(k_norm, config.rms_norm_eps, offset) if config.qk_norm else None
        self.clip_qkv = config.clip_qkv
        self.softcap = config.attn_logit_softcapping
        self.backend = backend
        # a sliding window the model was trained with: queries read only the last `window` keys (None: all)
        self.window = config.layer_windows[layer_idx] if config.layer_windows else None

    def _project(self, x: torch.Tensor, proj: nn.Module, norm: nn.Module | None, heads: int) -> torch.Tensor:
        """x [..., hidden] -> [..., heads, D] through `proj`, then `norm` and the clamp where the model has them."""
        y = proj(x)
        if norm is not None and not self.per_head_norm:
            y = norm(y)
        if self.clip_qkv is not None:
            y = y.clamp(-self.clip_qkv, self.clip_qkv)
        y = y.view(*x.shape[:-1], heads, self.head_dim)
        return y if norm is None or not self.per_head_norm else norm(y)

    def layer_rope(self, rope: Rope | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) this layer rotates with: the local table in a sliding layer of a model that has one."""
        local = getattr(rope, "local", None)
        return local if local is not None and self.window is not None else rope

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed inputs x [..., hidden] -> q [..., H, D], k, v [..., Hkv, D]; q and k rotated. Both forwards (the
        paged one here, leanlm.model.forward's over whole sequences) start from it."""
        rope = self.layer_rope(rope)
        q = self._project(x, self.q_proj, self.q_norm, self.num_heads)
        k = self._project(x, self.k_proj, self.k_norm, self.num_kv_heads)
        v = self._project(x, self.v_proj, None, self.num_kv_heads)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = x.shape[0]
        q = self._project(x, self.q_proj, self.q_norm, self.num_heads)  # [T, H, D]
        k = self._project(x, self.k_proj, self.k_norm, self.num_kv_heads)  # [T, Hkv, D]
        v = self._project(x, self.v_proj, None, self.num_kv_heads)
        q_sink = (
            None if ctx.long_inputs.sink_rope is None else apply_rotary(q, *ctx.long_inputs.sink_rope)
        )  # the re-based sinks' query
        rope = self.layer_rope(rope)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        kv = ctx.kv_cache.layer(self.layer_idx)
        if self.softcap is None:
            out = self.backend.forward(q, k, v, kv, self.scale, ctx, self.window, q_sink)
        else:
            out = capped_attention(q, k, v, kv, self.scale, ctx, self.window, q_sink, self.softcap)
        if ctx.query_observer is not None:
            ctx.query_observer(self.layer_idx, q, kv)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def write_kv(self, x: torch.Tensor, rope: Rope) -> None:
        """Store the K/V of normed inputs x [T, hidden] in this layer's cache at the forward context's slots,
        attending to nothing: CALM's state propagation for a token that left the network before this layer."""
        ctx = get_forward_context()
        k = self._project(x, self.k_proj, self.k_norm, self.num_kv_heads)  # [T, Hkv, D]
        v = self._project(x, self.v_proj, None, self.num_kv_heads)
        kv = ctx.kv_cache.layer(self.layer_idx)
        store_kv(kv.k_cache, kv.k_scales, apply_rotary(k, *self.layer_rope(rope)), ctx.kv_write_index)
        store_kv(kv.v_cache, kv.v_scales, v, ctx.kv_write_index)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with sandwich norms (Gemma) each branch's output
    is normed too before it is added."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        sparse = config.moe is not None and config.moe.is_sparse(layer_idx)
        self.linear_groups = layer_groups(config, sparse)
        offset, eps, hidden = config.arch.norm_offset, config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.self_attn = (
            LatentAttention(config, layer_idx) if config.mla is not None else LlamaAttention(config, backend, layer_idx)
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.sandwich = config.arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.mlp = SparseMoeBlock(config) if sparse else LlamaMLP(hidden, config.intermediate_size, config.hidden_act)

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def after_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual stream x [..., hidden] after the attention branch's output and then the MLP branch."""
        x = x + (self.post_attention_layernorm(attn_out) if self.sandwich else attn_out)
        h = self.mlp_norm(x)
        out = self.mlp(h.reshape(-1, h.shape[-1])).view_as(h)  # flat rows [N, hidden]: a sparse MLP routes rows
        return x + (self.post_feedforward_layernorm(out) if self.sandwich else out)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        return self.after_attention(x, self.self_attn(self.input_layernorm(x), rope))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # _weight: no random init (nn.init.normal_ under the meta device imports torch._dynamo, ~1 s of a load)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.arch.norm_offset)
        # Gemma: embeddings times sqrt(hidden), that factor rounded to the compute dtype as HF does
        self.embed_scale = config.hidden_size**0.5 if config.arch.scales_embeddings else None
        # trained early exits (config.exit_layers): read by drafts and training only, never by this forward
        self.exits = build_exits(config.hidden_size, config.rms_norm_eps, config.exit_layers, config.exit_adapter_rank)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> the residual stream's first value [..., hidden]: every forward starts here."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return x
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """Embeddings x [T, hidden] -> final-normed hidden [T, hidden]."""
        rope = rotary(positions, x.dtype)  # cos, sin [T, 1, D/2], shared by every layer
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, hidden]; compute_logits(hidden [N, .]) -> [N, V].

    Runs inside a forward context, whose KV cache it reads and writes: the model itself holds no cache.
    """

    def __init__(self, config: ModelConfig, attention_backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, get_backend(attention_backend))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb: RotaryEmbedding | None = None  # built on the real device by build_model
        # an early-exit draft's adapter, between its norm and the head (first_layers); None on a whole model
        self.head_adapter: nn.Module | None = None
        # Every layer in one native call for all-decode steps, per activation mode (the layers' calls differ),
        # rebuilt when the weights change.
        self._native_plans: dict[str, NativeDecodePlan] = {}
        self.allow_native_decode = True  # False keeps every step on the PyTorch path (tests compare the two)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.model.embed(input_ids)  # [T, hidden]
        ctx = get_forward_context()
        if self.allow_native_decode and ctx.is_all_decode and ctx.query_observer is None:
            hidden = self.native_decode_plan().run(x, positions, ctx)
            if hidden is not None:
                return hidden
        return self.model(x, positions, self.rotary_emb)

    def disable_native_decode(self) -> None:
        """Keep every step on the per-layer path from now on, and drop a plan built before: for a model whose layers
        the one native call cannot run (a tensor shard needs all-reduces between them, offloaded layers come and go)."""
        self.allow_native_decode = False
        self.drop_native_plan()

    def drop_native_plan(self) -> None:
        """Forget the native loops' plans: a module they read was replaced without a tensor changing (LoRA
        training wraps linears)."""
        self._native_plans.clear()

    def native_decode_plan(self) -> NativeDecodePlan:
        """The native decode loop over the current weights, for the step's activation mode (leanlm.model.linear.
        act_quant): the one built before while nothing it read has changed (leanlm.model.native_decode), else a new
        one."""
        mode = current_activation_quant()
        plan = self._native_plans.get(mode)
        if plan is None or not plan.is_current():
            plan = self._native_plans[mode] = NativeDecodePlan(self)
        return plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_adapter is not None:
            hidden = self.head_adapter(hidden)
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """This model cut after `num_layers` decoder layers, then the head: through the trained exit at that
        layer when the model has one (its norm as the draft's norm, its adapter before the head), else through
        the final norm (the early-exit draft of self-speculation). Every module, and so every weight, is shared:
        nothing is copied. Its layers keep their indices, so it reads the target's KV cache for them.
        """
        if not 1 <= num_layers < self.config.num_hidden_layers:
            raise ValueError(
                f"a draft of the first {num_layers} layers needs 1 <= layers < {self.config.num_hidden_layers}"
            )
        return self.layer_span(0, num_layers)

    def layer_span(self, start: int, end: int) -> LlamaForCausalLM:
        """Layers [start, end) of this model, then the head as `first_layers(end)` reads it (the final norm when
        `end` is the last layer). Its forward starts from embeddings; CALM's early exit runs the native decode loop
        of each span on the residual stream the span before left (leanlm.engine.early_exit). Shares every module.
        """
        count = self.config.num_hidden_layers
        if not 0 <= start < end <= count:
            raise ValueError(f"a span of layers [{start}, {end}) needs 0 <= start < end <= {count}")
        config = dataclasses.replace(
            self.config,
            num_hidden_layers=end - start,
            exit_layers=(),
            exit_adapter_rank=0,
            layer_windows=self.config.layer_windows[start:end],
        )
        with torch.device("meta"):
            span = LlamaForCausalLM(config)
        exit_head = self.model.exits[str(end)] if str(end) in self.model.exits and end < count else None
        span.model.embed_tokens = self.model.embed_tokens
        # the exit's norm stands where the final norm was, so the native decode loop runs the span unchanged
        span.model.norm = self.model.norm if exit_head is None else exit_head.norm
        span.head_adapter = None if exit_head is None else exit_head.adapter
        span.model.layers = nn.ModuleList(self.model.layers[start:end])
        span.lm_head, span.rotary_emb = self.lm_head, self.rotary_emb
        span.allow_native_decode = self.allow_native_decode
        return span.eval()


class CheckpointMismatchError(ValueError):
    """The weights or runtime layers given to build_model do not fit the network its config describes."""


def _check_replacement(model: nn.Module, name: str, layer: nn.Module) -> None:
    """A runtime layer may stand in for a linear only with the linear's (out, in) features: the kernels size
    their buffers from the model's dimensions (loading/shapes.py checks checkpoints before this)."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise CheckpointMismatchError(f"quantized layer {name} names no module of this model") from None
    want = (linear.out_features, linear.in_features)
    got = (getattr(layer, "out_features", None), getattr(layer, "in_features", None))
    if got != want:
        raise CheckpointMismatchError(
            f"quantized layer {name} has (out, in) features {got}, but the model's {name} is {want}"
        )


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
        _check_replacement(model, name, layer)
        model.set_submodule(name, layer.to(device).set_compute_dtype(dtype))
    weights = {name: t.to(device=device, dtype=dtype) for name, t in state_dict.items()}
    if config.tie_word_embeddings:
        if "lm_head.weight" in weights:
            raise CheckpointMismatchError(
                "tied-embedding model has an lm_head.weight tensor; set tie_word_embeddings=False"
            )
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    prefixes = tuple(name + "." for name in quantized or {})
    expected = {k for k in model.state_dict() if not k.startswith(prefixes)}
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"checkpoint does not match the {config.architecture} architecture: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(weights, assign=True, strict=not quantized)
    model.rotary_emb = RotaryEmbedding(
        config.rope_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, config.rope_local_theta
    ).to(device)
    return model.eval().requires_grad_(False)
