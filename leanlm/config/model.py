"""ModelConfig: one Llama-family decoder (llama, qwen2 are flags, not classes), built from an HF `config.json`
dict or from GGUF metadata (`leanlm.loading.gguf`); RopeScaling; the dtype names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from leanlm.config.moe import MoEConfig, check_hf_expressible, moe_from_hf, moe_to_hf
from leanlm.config.values import check_bool, check_dict, check_float, check_int, check_list, optional, required, to_int

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "olmoe")
# HF's class for each architecture (what `architectures` in config.json names)
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "mixtral": "MixtralForCausalLM",
              "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}  # fmt: skip
_BIAS_DEFAULT = {"qwen2": True, "qwen2_moe": True}  # q/k/v bias when config.json does not say
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
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (rope_type 'llama3'); 'linear' divides positions."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; use 'llama3' or 'linear'")
        check_float(self.factor, "rope_scaling factor", 0.0)
        check_float(self.low_freq_factor, "rope_scaling low_freq_factor", 0.0)
        check_float(self.high_freq_factor, "rope_scaling high_freq_factor", 0.0)
        check_int(self.original_max_position_embeddings, "rope_scaling original_max_position_embeddings")
        # llama3's smoothing divides by their difference
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling high_freq_factor ({self.high_freq_factor}) must be above low_freq_factor "
                f"({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder, with HF field names. Mixtral, Qwen2-MoE and OLMoE are
    this decoder with a sparse MLP (`moe`); OLMoE adds `qk_norm` and `clip_qkv`."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES; qwen2 = llama + q/k/v bias
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
    qk_norm: bool = False  # RMSNorm over the whole q and k projections before rotary (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to [-c, c] after projection (OLMoE, OLMo)
    # sliding-window attention as trained (Mistral, Qwen2's use_sliding_window + max_window_layers, `layer_types`):
    # layer i's queries read only the last layer_windows[i] tokens, themselves included; None or () : every token
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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
        for flag in ("tie_word_embeddings", "attention_bias", "qk_norm"):
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
        if self.architecture in ("mixtral", "qwen2_moe", "olmoe") and self.moe is None:
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
        if self.qk_norm and self.architecture != "olmoe":
            raise ValueError("qk_norm (a norm over the whole q and k projections) is OLMoE's; use architecture='olmoe'")
        if self.clip_qkv is not None:
            check_float(self.clip_qkv, "ModelConfig.clip_qkv", 0.0)
        check_int(self.exit_adapter_rank, "ModelConfig.exit_adapter_rank", minimum=0)
        if self.exit_adapter_rank and not layers:
            raise ValueError(f"exit_adapter_rank {self.exit_adapter_rank} needs exit_layers (the heads it adapts)")

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
            "q_norm": (q_rows,),
            "k_norm": (kv_rows,),
        }
        module, kind = hf_name.rsplit(".", 2)[-2:]
        if self.moe is not None:
            width = self.moe.expert_intermediate_size if ".mlp.experts." in hf_name else None
            width = self.moe.shared_expert_intermediate_size if ".mlp.shared_expert." in hf_name else width
            if width is not None:
                shapes |= {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
            shapes |= {"gate": (self.moe.num_experts, hidden), "shared_expert_gate": (1, hidden)}
        shape = shapes.get(module, (hidden,))  # the rest are norms: [hidden]
        return shape[:1] if kind == "bias" else shape

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (LlamaForCausalLM / Qwen2ForCausalLM). Every value is
        checked for its kind and range here, so that a wrong one is a ValueError naming its key (the loader makes
        it a ModelLoadError), never an exception from the math it would have reached."""
        check_dict(cfg, "config.json")
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
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
        bias_default = _BIAS_DEFAULT.get(model_type, False)
        return cls(
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
            rope_scaling=_hf_rope_scaling(raw_scaling),
            tie_word_embeddings=check_bool(optional(cfg, "tie_word_embeddings", False), "tie_word_embeddings"),
            attention_bias=check_bool(
                optional(cfg, "attention_bias", optional(cfg, "qkv_bias", bias_default)), "attention_bias (qkv_bias)"
            ),
            bos_token_id=None if bos is None else to_int(bos, "bos_token_id", minimum=0),
            eos_token_ids=tuple(to_int(i, "eos_token_id", minimum=0) for i in eos_ids),
            name=str(cfg.get("_name_or_path", "")),
            exit_layers=tuple(
                to_int(k, "leanlm_exits.layers") for k in check_list(exits.get("layers", ()), "leanlm_exits.layers")
            ),
            exit_adapter_rank=to_int(optional(exits, "adapter_rank", 0), "leanlm_exits.adapter_rank", minimum=0),
            moe=moe_from_hf(model_type, cfg, num_layers),
            qk_norm=model_type == "olmoe",
            clip_qkv=None if clip is None else check_float(clip, "clip_qkv", 0.0),
            layer_windows=hf_layer_windows(model_type, cfg, num_layers),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face loader reads for this model."""
        cfg: dict[str, Any] = {
            "architectures": [HF_CLASSES[self.architecture]],
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
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.architecture in ("llama", "olmoe"):
            cfg["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            cfg["mlp_bias"] = False
        if self.architecture == "qwen2_moe":
            cfg["qkv_bias"] = self.attention_bias
        if self.moe is not None:
            cfg |= moe_to_hf(self.architecture, self.moe, self.num_hidden_layers)
        if self.clip_qkv is not None:
            cfg["clip_qkv"] = self.clip_qkv
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        cfg |= layer_windows_to_hf(self.architecture, self.layer_windows)
        if self.exit_layers:  # HF loaders ignore the key (and the exits' tensors)
            cfg["leanlm_exits"] = {"layers": list(self.exit_layers), "adapter_rank": self.exit_adapter_rank}
        return cfg


def _hf_rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    """config.json's rope_scaling (or rope_parameters) object; None for default rotary."""
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_scaling rope_type must be a string, got {rope_type!r}")
    return RopeScaling(
        rope_type=rope_type,
        factor=check_float(required(raw, "factor", "rope_scaling"), "rope_scaling factor", 0.0),
        low_freq_factor=check_float(optional(raw, "low_freq_factor", 1.0), "rope_scaling low_freq_factor", 0.0),
        high_freq_factor=check_float(optional(raw, "high_freq_factor", 4.0), "rope_scaling high_freq_factor", 0.0),
        original_max_position_embeddings=to_int(
            optional(raw, "original_max_position_embeddings", 8192), "rope_scaling original_max_position_embeddings"
        ),
    )


def hf_layer_windows(model_type: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window from an HF config.json, as transformers reads it: `layer_types` where the
    config lists them ("sliding_attention" layers get `sliding_window`); else Qwen2's use_sliding_window from layer
    max_window_layers on; else, for Mistral and Mixtral, `sliding_window` on every layer. () when every layer is
    full (HF leaves qwen2's window off unless use_sliding_window is set)."""
    window = cfg.get("sliding_window")
    window = None if window is None else to_int(window, "sliding_window", minimum=0) or None  # 0: no window
    types = cfg.get("layer_types")
    if types is not None:
        types = check_list(types, "layer_types")
        if len(types) != num_layers:
            raise ValueError(f"config.json layer_types lists {len(types)} layers, the model has {num_layers}")
        unknown = [t for t in types if t not in ("full_attention", "sliding_attention")]
        if unknown:
            raise ValueError(f"config.json layer_types has {unknown[:3]}; leanlm runs full and sliding attention")
        windows = tuple(window if t == "sliding_attention" and window else None for t in types)
    elif model_type in ("qwen2", "qwen2_moe"):
        start = to_int(optional(cfg, "max_window_layers", num_layers), "max_window_layers", minimum=0)
        on = check_bool(optional(cfg, "use_sliding_window", False), "use_sliding_window") and window
        windows = tuple(window if on and i >= start else None for i in range(num_layers)) if on else ()
    elif model_type in ("mistral", "mixtral") and window:
        windows = (window,) * num_layers
    else:
        windows = ()
    return windows if any(w is not None for w in windows) else ()


def layer_windows_to_hf(architecture: str, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """The config.json keys that give an HF loader these windows: `sliding_window` and `layer_types`."""
    if not windows:
        return {}
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"HF configs hold one sliding_window size; these layers have {sorted(sizes)}")
    types = ["sliding_attention" if w is not None else "full_attention" for w in windows]
    extra = {"use_sliding_window": True} if architecture in ("qwen2", "qwen2_moe") else {}
    return {"sliding_window": sizes.pop(), "layer_types": types} | extra
