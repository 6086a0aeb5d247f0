"""ModelConfig: the shape and hyper-parameters of one decoder, whose architecture (leanlm.config.architectures) says
what its block is; built from an HF `config.json` dict or from GGUF metadata (`leanlm.formats.gguf.config`); the dtype
names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from leanlm.config.architectures import SUPPORTED_ARCHITECTURES, Architecture, get_architecture
from leanlm.config.architectures.spec import HIDDEN_ACTS
from leanlm.config.mla import MLAConfig
from leanlm.config.moe import MoEConfig, check_hf_expressible, moe_from_hf, moe_to_hf
from leanlm.config.rope import RopeScaling, hf_rope_scaling
from leanlm.config.values import check_bool, check_dict, check_float, check_int, check_list, optional, required, to_int
from leanlm.config.windows import hf_layer_windows, layer_windows_to_hf

# The longest context we build rotary tables for: 2^20 positions x D/2 x cos/sin in float32 is already 512 MiB
# at head_dim 128. A larger value in a file is damage (or a model we cannot serve), never something to allocate.
MAX_POSITION_EMBEDDINGS = 1 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or aliases fp32/bf16/fp16) or a torch dtype -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    name = aliases.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder, with HF field names. What is fixed per family (norms, q/k norms,
    embedding scale, ...) is its `arch`; what checkpoints of one family vary is here."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES: HF's model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int  # the context length
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q_proj / k_proj / v_proj (qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (eos, eot, im_end, ...)
    name: str = ""  # human-readable model name, for logs
    # trained early-exit heads (leanlm.model.exit_head): after how many layers each reads the residual stream,
    # and the rank of their adapters (0 = an RMSNorm only); saved in config.json as "leanlm_exits"
    exit_layers: tuple[int, ...] = ()
    exit_adapter_rank: int = 0
    moe: MoEConfig | None = None  # the sparse MLP of the layers it names (leanlm.model.moe); None: dense
    clip_qkv: float | None = None  # q, k and v clamped to [-c, c] after projection (OLMoE, OLMo)
    # sliding-window attention as trained (Mistral, Qwen2's use_sliding_window + max_window_layers, `layer_types`):
    # layer i's queries read only the last layer_windows[i] tokens, themselves included; None or () : every token
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the MLP gate's activation: one of HIDDEN_ACTS
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power (Gemma); None: head_dim's
    attn_logit_softcapping: float | None = None  # attention scores c * tanh(s / c) (Gemma 2); None: uncapped
    final_logit_softcapping: float | None = None  # logits likewise (Gemma 2)
    rope_local_theta: float | None = None  # the rope base of the sliding-window layers (Gemma 3); None: rope_theta
    rotary_dim: int | None = None  # rotary on the first rotary_dim of each head (Phi-4-mini); None: all head_dim
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3); head_dim is then q/k's per head

    def __post_init__(self) -> None:
        get_architecture(self.architecture)  # a ValueError listing the supported ones
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            check_int(getattr(self, field), f"ModelConfig.{field}")
        check_int(self.max_position_embeddings, "ModelConfig.max_position_embeddings", maximum=1 << 64)
        if self.max_position_embeddings > MAX_POSITION_EMBEDDINGS:
            raise ValueError(
                f"max_position_embeddings (context length) is {self.max_position_embeddings}, above the "
                f"{MAX_POSITION_EMBEDDINGS} positions leanlm builds rotary tables for; the model file is damaged, "
                "or fix the value in its config (a smaller context is safe: it only limits prompt + output length)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        # eps > 1 would swamp the mean square of any normalised activation; NaN made every logit NaN
        check_float(self.rms_norm_eps, "ModelConfig.rms_norm_eps", 0.0, 1.0)
        check_float(self.rope_theta, "ModelConfig.rope_theta", 0.0)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        for flag in ("tie_word_embeddings", "attention_bias"):
            check_bool(getattr(self, flag), f"ModelConfig.{flag}")
        if self.bos_token_id is not None:
            check_int(self.bos_token_id, "ModelConfig.bos_token_id", minimum=0)
        for token_id in self.eos_token_ids:
            check_int(token_id, "ModelConfig.eos_token_ids", minimum=0)
        if not isinstance(self.name, str):
            raise ValueError(f"ModelConfig.name must be a string, got {self.name!r}")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"ModelConfig.moe must be a MoEConfig or None, got {self.moe!r}")
        for k in self.exit_layers:
            check_int(k, "ModelConfig.exit_layers")
        layers = self.exit_layers
        if list(layers) != sorted(set(layers)) or any(not 1 <= k < self.num_hidden_layers for k in layers):
            raise ValueError(
                f"exit_layers must be increasing layer counts in 1..{self.num_hidden_layers - 1}, got {layers}"
            )
        if self.moe is not None and self.moe.sparse_layers and max(self.moe.sparse_layers) >= self.num_hidden_layers:
            raise ValueError(f"moe.sparse_layers {self.moe.sparse_layers} name layers past {self.num_hidden_layers}")
        if self.arch.moe and self.moe is None:
            raise ValueError(f"a {self.architecture} model needs its MoEConfig (moe=)")
        if self.moe is not None:
            check_hf_expressible(self.architecture, self.moe)
        if self.layer_windows and (
            len(self.layer_windows) != self.num_hidden_layers
            or any(
                w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in self.layer_windows
            )
        ):
            raise ValueError(
                f"layer_windows needs one window (a token count >= 1, or None for full attention) per layer "
                f"({self.num_hidden_layers}), got {self.layer_windows}"
            )
        self._check_block()
        if self.clip_qkv is not None:
            check_float(self.clip_qkv, "ModelConfig.clip_qkv", 0.0)
        check_int(self.exit_adapter_rank, "ModelConfig.exit_adapter_rank", minimum=0)
        if self.exit_adapter_rank and not layers:
            raise ValueError(f"exit_adapter_rank {self.exit_adapter_rank} needs exit_layers (the heads it adapts)")

    def _check_block(self) -> None:
        """The knobs of the block: values a file may carry wrong."""
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden activation {self.hidden_act!r} is not supported; supported: {HIDDEN_ACTS}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            if getattr(self, name) is not None:
                check_float(getattr(self, name), f"ModelConfig.{name}", 0.0)
        if self.rotary_dim is not None:
            check_int(self.rotary_dim, "ModelConfig.rotary_dim")
            if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and at most head_dim ({self.head_dim})")
        if self.mla is not None and (
            not isinstance(self.mla, MLAConfig) or self.mla.qk_head_dim != self.head_dim or self.rotary_dim
        ):
            raise ValueError(f"an MLA model's head_dim ({self.head_dim}) is qk_nope + qk_rope of its {self.mla}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope" and 2 * len(scaling.short_factor) != self.rope_dim:
            raise ValueError(
                f"longrope gives {len(scaling.short_factor)} factors; the rotary dimension {self.rope_dim} needs "
                f"{self.rope_dim // 2}"
            )

    @property
    def arch(self) -> Architecture:
        """What this model's block is (leanlm.config.architectures)."""
        return get_architecture(self.architecture)

    @property
    def qk_norm(self) -> str:
        """ "" (none), "whole" (one norm over every head's q or k: OLMoE) or "head" (per head: Qwen3, Gemma 3)."""
        return self.arch.qk_norm

    @property
    def rope_dim(self) -> int:
        """How many of each head's dimensions rotary turns (the rest pass through)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def cache_kv_heads(self) -> int:
        """KV heads a paged cache block holds per layer: one latent "head" under MLA."""
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        """Values per cache head, token and K or V slot: MLA's latent row is split over the two slots."""
        return self.head_dim if self.mla is None else self.mla.latent_width // 2

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        scale = (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5
        if self.mla is not None and self.rope_scaling is not None:  # DeepSeek's yarn temperature, squared
            scale *= self.rope_scaling.softmax_scale
        return scale

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        """The shape the HF tensor `hf_name` (`model.layers.3.mlp.down_proj.weight`, ...) has in this model: [out,
        in] for a linear's weight, [out] for its bias, [hidden] for a norm. Every checkpoint format is checked
        against it before any kernel sees a tensor."""
        q_rows = self.num_attention_heads * self.head_dim
        kv_rows = self.num_key_value_heads * self.head_dim
        hidden, inter = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (q_rows, hidden),
            "k_proj": (kv_rows, hidden),
            "v_proj": (kv_rows, hidden),
            "o_proj": (hidden, q_rows),
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
            "embed_tokens": (self.vocab_size, hidden),
            "lm_head": (self.vocab_size, hidden),
            "qkv_proj": (q_rows + 2 * kv_rows, hidden),  # Phi-3's files, split on read
            "gate_up_proj": (2 * inter, hidden),
            "q_norm": (self.head_dim,) if self.qk_norm == "head" else (q_rows,),
            "k_norm": (self.head_dim,) if self.qk_norm == "head" else (kv_rows,),
        }
        if self.mla is not None:
            shapes |= self._mla_shapes()
        module, kind = hf_name.rsplit(".", 2)[-2:]
        if self.moe is not None:
            width = self.moe.expert_intermediate_size if ".mlp.experts." in hf_name else None
            width = self.moe.shared_expert_intermediate_size if ".mlp.shared_expert." in hf_name else width
            if width is not None:
                shapes |= {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
            shapes |= {"gate": (self.moe.num_experts, hidden), "shared_expert_gate": (1, hidden)}
        shape = shapes.get(module, (hidden,))  # the rest are norms: [hidden]
        return shape[:1] if kind in ("bias", "e_score_correction_bias") else shape

    def _mla_shapes(self) -> dict[str, tuple[int, ...]]:
        mla, heads, hidden = self.mla, self.num_attention_heads, self.hidden_size
        shapes = {
            "q_proj": (heads * mla.qk_head_dim, hidden),
            "kv_a_proj_with_mqa": (mla.latent_width, hidden),
            "kv_a_layernorm": (mla.kv_lora_rank,),
            "kv_b_proj": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            "o_proj": (hidden, heads * mla.v_head_dim),
        }
        if mla.q_lora_rank is not None:
            rank = mla.q_lora_rank
            shapes |= {
                "q_a_proj": (rank, hidden),
                "q_a_layernorm": (rank,),
                "q_b_proj": (heads * mla.qk_head_dim, rank),
            }
        return shapes

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict: the keys every family shares here, its own through its
        architecture's `read_config`. Every value is checked for its kind and range, so that a wrong one is a
        ValueError naming its key (the loader makes it a ModelLoadError), never an exception from the math."""
        check_dict(cfg, "config.json")
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = get_architecture(model_type)
        num_heads = to_int(required(cfg, "num_attention_heads"), "num_attention_heads")
        hidden = to_int(required(cfg, "hidden_size"), "hidden_size")
        num_layers = to_int(required(cfg, "num_hidden_layers"), "num_hidden_layers")
        # transformers >= 5 writes `rope_parameters` (rope_theta inside); older configs `rope_scaling`.
        rope_params = check_dict(cfg.get("rope_parameters") or {}, "rope_parameters")
        raw_scaling = check_dict(cfg.get("rope_scaling") or rope_params, "rope_scaling")
        head_dim = cfg.get("head_dim")
        if head_dim is None and hidden % num_heads:
            raise ValueError(
                f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({num_heads}) and config.json "
                "gives no head_dim"
            )
        exits = check_dict(cfg.get("leanlm_exits") or {}, "leanlm_exits")
        eos = cfg.get("eos_token_id")
        eos_ids = check_list(eos, "eos_token_id") if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        bos = cfg.get("bos_token_id")
        clip = cfg.get("clip_qkv")
        fields = dict(
            architecture=model_type,
            vocab_size=to_int(required(cfg, "vocab_size"), "vocab_size"),
            hidden_size=hidden,
            intermediate_size=to_int(required(cfg, "intermediate_size"), "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=to_int(optional(cfg, "num_key_value_heads", num_heads), "num_key_value_heads"),
            head_dim=hidden // num_heads if head_dim is None else to_int(head_dim, "head_dim"),
            # bounded by __post_init__, whose message says what the bound is for
            max_position_embeddings=to_int(
                optional(cfg, "max_position_embeddings", 2048), "max_position_embeddings", maximum=1 << 64
            ),
            rms_norm_eps=check_float(optional(cfg, "rms_norm_eps", 1e-6), "rms_norm_eps", 0.0, 1.0),
            rope_theta=check_float(
                optional(cfg, "rope_theta", optional(rope_params, "rope_theta", 10000.0)), "rope_theta"
            ),
            rope_scaling=hf_rope_scaling(raw_scaling, cfg),
            tie_word_embeddings=check_bool(optional(cfg, "tie_word_embeddings", False), "tie_word_embeddings"),
            attention_bias=check_bool(
                optional(cfg, "attention_bias", optional(cfg, "qkv_bias", arch.qkv_bias)), "attention_bias (qkv_bias)"
            ),
            bos_token_id=None if bos is None else to_int(bos, "bos_token_id", minimum=0),
            eos_token_ids=tuple(to_int(i, "eos_token_id", minimum=0) for i in eos_ids),
            name=str(cfg.get("_name_or_path", "")),
            exit_layers=tuple(
                to_int(k, "leanlm_exits.layers") for k in check_list(exits.get("layers", ()), "leanlm_exits.layers")
            ),
            exit_adapter_rank=to_int(optional(exits, "adapter_rank", 0), "leanlm_exits.adapter_rank", minimum=0),
            moe=moe_from_hf(arch.moe, cfg, num_layers),
            clip_qkv=None if clip is None else check_float(clip, "clip_qkv", 0.0),
            layer_windows=hf_layer_windows(arch, cfg, num_layers),
            hidden_act=str(cfg.get("hidden_act") or arch.default_act),
        )
        if arch.read_config is not None:
            fields |= arch.read_config(cfg, num_layers)
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face loader reads for this model."""
        arch = self.arch
        cfg: dict[str, Any] = {
            "architectures": [arch.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.moe is not None:
            cfg |= moe_to_hf(arch.moe, self.moe, self.num_hidden_layers)
        if self.clip_qkv is not None:
            cfg["clip_qkv"] = self.clip_qkv
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling.to_hf()
        cfg |= layer_windows_to_hf(self.architecture, self.layer_windows)
        if arch.write_config is not None:
            cfg |= arch.write_config(self)
        if self.exit_layers:  # HF loaders ignore the key (and the exits' tensors)
            cfg["leanlm_exits"] = {"layers": list(self.exit_layers), "adapter_rank": self.exit_adapter_rank}
        return cfg
