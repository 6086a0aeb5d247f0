"""ModelShape: what the cost estimator needs to know about a decoder (sizes, GQA, gating, MoE, biases), built
from our ModelConfig (bundled name, GGUF file, HF directory) or from a built-in preset of a well-known model.

It is the estimator's own description because ModelConfig only describes models we can run (gated SiLU MLP,
RMSNorm, RoPE); GPT-3 (plain GELU MLP, LayerNorm, learned positions, biases) is not. MoE shapes (Mixtral, Qwen2-MoE,
OLMoE, our own) carry their experts, a shared expert and the layers without experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from leanlm.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer; lengths are tokens, dims are elements."""

    name: str
    vocab_size: int
    hidden_size: int  # d
    intermediate_size: int  # F, per expert for MoE
    num_hidden_layers: int  # L
    num_attention_heads: int  # H (query heads)
    num_key_value_heads: int  # Hkv: H for MHA, 1 for MQA, between for GQA
    head_dim: int  # D; H * D is the attention width (== d for most models)
    tie_word_embeddings: bool = False  # lm_head reuses embed_tokens (no extra matrix)
    mlp_gated: bool = True  # gate/up/down (SwiGLU, 3 matrices) vs up/down (GELU MLP, 2 matrices)
    attention_bias: bool = False  # bias on q/k/v (qwen2, GPT)
    dense_bias: bool = False  # bias on o_proj and the MLP matrices (GPT-2/3)
    norm_bias: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight only)
    num_position_embeddings: int = 0  # learned absolute positions (GPT); 0 with RoPE
    num_experts: int = 1  # E routed experts per layer; 1 = dense MLP, no router
    experts_per_token: int = 1  # k experts each token runs through (top-k routing)
    shared_expert_intermediate_size: int = 0  # an always-on expert in every MoE layer (Qwen2-MoE); 0: none
    shared_expert_gate: bool = False  # its sigmoid gate, a [1, d] vector per MoE layer
    num_moe_layers: int | None = None  # layers with experts; None: all of them (when is_moe)
    dense_intermediate_size: int = 0  # FFN width of the layers without experts (Qwen2-MoE's mlp_only_layers)
    # q/k norms: "whole" over all of q and k (OLMoE: (H + Hkv) * D weights per layer), "head" one per head shared by
    # the heads (Qwen3, Gemma 3: 2 * D per layer); "" none
    qk_norm: str = ""
    norms_per_layer: int = 2  # Gemma 2/3 norm each branch's output too: 4
    # multi-head latent attention (DeepSeek-V2/V3): the KV latent's width (0: not MLA; the cache then holds it and
    # qk_rope_head_dim per token and layer), the queries' bottleneck (0: none), the shared rotary key's and each
    # head's value width; head_dim is q/k's per head
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    max_context: int | None = None  # tokens the model was trained to attend to (max_position_embeddings); None: unknown

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "experts_per_token",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) cannot exceed num_experts "
                f"({self.num_experts}); use num_experts=1, experts_per_token=1 for a dense MLP"
            )
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1 tokens (or None when unknown), got {self.max_context}")
        if self.num_position_embeddings < 0:
            raise ValueError(f"num_position_embeddings must be >= 0 (0 = RoPE), got {self.num_position_embeddings}")
        self._check_moe()

    def _check_moe(self) -> None:
        if min(self.shared_expert_intermediate_size, self.dense_intermediate_size) < 0:
            raise ValueError("shared_expert_intermediate_size and dense_intermediate_size must be >= 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert: set shared_expert_intermediate_size")
        if self.num_moe_layers is None:
            return
        if not self.is_moe or not 1 <= self.num_moe_layers <= self.num_hidden_layers:
            raise ValueError(
                f"num_moe_layers ({self.num_moe_layers}) must be between 1 and num_hidden_layers "
                f"({self.num_hidden_layers}) on a model with num_experts > 1; None means every layer"
            )
        if self.num_moe_layers < self.num_hidden_layers and not self.dense_intermediate_size:
            raise ValueError("layers without experts need their FFN width: set dense_intermediate_size")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def moe_layers(self) -> int:
        """Layers with experts: 0 for a dense model."""
        if not self.is_moe:
            return 0
        return self.num_hidden_layers if self.num_moe_layers is None else self.num_moe_layers

    @property
    def attention_width(self) -> int:
        """H * D: the width of the queries (and of the attention output fed to o_proj)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Hkv * D: the width of one K (or V) row per token per layer."""
        return self.num_key_value_heads * self.head_dim


def _mla_fields(config: ModelConfig) -> dict[str, int]:
    mla = config.mla
    if mla is None:
        return {}
    return {"kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank or 0,
            "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim}  # fmt: skip


def shape_from_config(config: ModelConfig, name: str = "") -> ModelShape:
    """Our runnable models are all gated-SiLU, RMSNorm, RoPE decoders; an MoE one carries its experts."""
    moe = config.moe
    sparse = None if moe is None or moe.sparse_layers is None else len(moe.sparse_layers)
    return ModelShape(
        name=name or config.name,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size if moe is None else moe.expert_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        num_experts=1 if moe is None else moe.num_experts,
        experts_per_token=1 if moe is None else moe.top_k,
        shared_expert_intermediate_size=0 if moe is None else moe.shared_expert_intermediate_size,
        shared_expert_gate=moe is not None and moe.shared_expert_gate,
        num_moe_layers=None if sparse in (None, config.num_hidden_layers) else sparse,
        dense_intermediate_size=config.intermediate_size if sparse not in (None, config.num_hidden_layers) else 0,
        qk_norm=config.qk_norm,
        norms_per_layer=4 if config.arch.sandwich_norms else 2,
        **_mla_fields(config),
        max_context=config.max_position_embeddings,
    )


def _llama(
    name: str, d: int, layers: int, heads: int, kv_heads: int, ffn: int, context: int, vocab: int = 32000
) -> ModelShape:
    return ModelShape(
        name=name,
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d // heads,
        max_context=context,
    )


# Shapes from the papers / released config.json files.
PRESETS: dict[str, ModelShape] = {
    "llama-7b": _llama("llama-7b", 4096, 32, 32, 32, 11008, 2048),  # LLaMA (Touvron et al. 2023)
    "llama-2-7b": _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 4096),  # the llama-7b shape at twice the context
    "llama-2-13b": _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 4096),
    "llama-2-70b": _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 4096),  # GQA: 8 KV heads
    "llama-3-8b": _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 8192, vocab=128256),
    # Llama 3.1 8B: the Llama 3 8B shape, trained on to a 128k context (rope scaling, which the estimate ignores)
    "llama-3.1-8b": _llama("llama-3.1-8b", 4096, 32, 32, 8, 14336, 131072, vocab=128256),
    # GPT-3 175B (Brown et al. 2020, table 2.1): d=12288, 96 layers x 96 heads of 128, FFN 4d, 2048 learned
    # positions, GPT-2 BPE vocab; a plain GELU MLP with biases, LayerNorm, tied embeddings (as GPT-2).
    "gpt-3-175b": ModelShape(
        name="gpt-3-175b",
        vocab_size=50257,
        hidden_size=12288,
        intermediate_size=4 * 12288,
        num_hidden_layers=96,
        num_attention_heads=96,
        num_key_value_heads=96,
        head_dim=128,
        tie_word_embeddings=True,
        mlp_gated=False,
        attention_bias=True,
        dense_bias=True,
        norm_bias=True,
        num_position_embeddings=2048,
        max_context=2048,
    ),
    # Mixtral 8x7B (Jiang et al. 2024): the Mistral 7B shape with 8 SwiGLU experts per layer, top-2 routing.
    "mixtral-8x7b": ModelShape(
        name="mixtral-8x7b",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_experts=8,
        experts_per_token=2,
        max_context=32768,
    ),
    # OLMoE-1B-7B (Muennighoff et al. 2024): 64 experts of 1024, top-8, in all 16 layers; q/k norms.
    "olmoe-1b-7b": ModelShape(
        name="olmoe-1b-7b",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        num_experts=64,
        experts_per_token=8,
        qk_norm="whole",
        max_context=4096,
    ),
    # Qwen1.5-MoE-A2.7B: 60 experts of 1408, top-4, and a gated shared expert of 5632 in all 24 layers.
    "qwen1.5-moe-a2.7b": ModelShape(
        name="qwen1.5-moe-a2.7b",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=1408,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        attention_bias=True,
        num_experts=60,
        experts_per_token=4,
        shared_expert_intermediate_size=5632,
        shared_expert_gate=True,
        max_context=8192,
    ),
}


def load_shape(name_or_path: str | Path) -> tuple[ModelShape, str]:
    """A preset name, bundled model name, GGUF file or HF directory -> (shape, where it came from).
    Only metadata is read, never the weights."""
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)], "preset"
    from leanlm.formats.gguf import open_gguf
    from leanlm.formats.gguf.config import gguf_model_config
    from leanlm.formats.hf_dir import read_hf_config
    from leanlm.formats.inspect import inspect
    from leanlm.loading.errors import ModelLoadError

    try:
        source = inspect(name_or_path)
    except ModelLoadError as exc:
        raise ValueError(f"{exc}; or use a preset: {', '.join(PRESETS)}") from None
    path = source.path
    config = read_hf_config(path) if source.is_directory else gguf_model_config(open_gguf(path))
    return shape_from_config(config, name=str(name_or_path)), str(path)
