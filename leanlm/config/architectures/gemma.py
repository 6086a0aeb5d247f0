"""Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm weights stored minus one, a norm before
and after both attention and MLP, a GELU-tanh gate, the attention scale 1/sqrt(query_pre_attn_scalar), sliding and
global layers interleaved (Gemma 2: every other; Gemma 3: five local to one global, the local ones on their own
rope base), logit soft-capping where the config sets it (Gemma 2), and per-head q/k norms (Gemma 3)."""

from __future__ import annotations

from typing import Any

from leanlm.config.architectures.spec import Architecture, Field
from leanlm.config.values import check_bool, check_dict, check_float, optional, to_int

# GGUF tensor names of the sandwich norms (llama.cpp's ffn_norm is the norm *before* the MLP here)
_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_SLIDING_EVERY = {"gemma2": 2, "gemma3_text": 6}  # a global layer closes each run of this many layers
_LOCAL_THETA = 10000.0  # Gemma 3's sliding layers' rope base (llama.cpp hard-codes it; configs say so too)


def _windows(pattern: int, window: int | None, num_layers: int) -> tuple[int | None, ...]:
    """HF's default layer_types: layer i is global when (i + 1) is a multiple of `pattern`, else sliding."""
    if not window:
        return ()
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))


def _optional_float(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    return None if value is None else check_float(value, key, 0.0)


def _read(model_type: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    from leanlm.config.rope import hf_rope_scaling

    if check_bool(optional(cfg, "use_bidirectional_attention", False), "use_bidirectional_attention"):
        raise ValueError("a Gemma with bidirectional attention is an embedding model (EmbeddingGemma), not a decoder")
    out: dict[str, Any] = {
        "hidden_act": str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
        "query_pre_attn_scalar": _optional_float(cfg, "query_pre_attn_scalar"),
        "attn_logit_softcapping": _optional_float(cfg, "attn_logit_softcapping"),
        "final_logit_softcapping": _optional_float(cfg, "final_logit_softcapping"),
    }
    if cfg.get("layer_types") is None:  # configs from before transformers wrote them
        window = cfg.get("sliding_window")
        window = None if window is None else to_int(window, "sliding_window")
        pattern = optional(cfg, "sliding_window_pattern", optional(cfg, "_sliding_window_pattern", 0))
        pattern = to_int(pattern or _SLIDING_EVERY[model_type], "sliding_window_pattern")
        out["layer_windows"] = _windows(pattern, window, num_layers)
    if model_type == "gemma3_text":
        params = check_dict(cfg.get("rope_parameters") or {}, "rope_parameters")
        if "full_attention" in params:  # transformers >= 5: one rope per layer type
            full = check_dict(params["full_attention"], "rope_parameters.full_attention")
            local = check_dict(params.get("sliding_attention") or {}, "rope_parameters.sliding_attention")
            if hf_rope_scaling(local, cfg) is not None:
                raise ValueError("Gemma 3's sliding layers take default rotary; rope_parameters scales them")
            out["rope_theta"] = check_float(optional(full, "rope_theta", 1e6), "rope_theta", 0.0)
            out["rope_scaling"] = hf_rope_scaling(full, cfg)
            out["rope_local_theta"] = check_float(optional(local, "rope_theta", _LOCAL_THETA), "rope_theta", 0.0)
        else:
            out["rope_local_theta"] = check_float(
                optional(cfg, "rope_local_base_freq", _LOCAL_THETA), "rope_local_base_freq", 0.0
            )
    return out


def _write(config) -> dict[str, Any]:
    out = {
        "hidden_activation": config.hidden_act,
        "query_pre_attn_scalar": _integral(config.query_pre_attn_scalar),
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "attention_bias": config.attention_bias,
    }
    if config.architecture == "gemma3_text":
        full = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_scaling is not None:
            full = config.rope_scaling.to_hf() | {"rope_theta": config.rope_theta}
        local = {"rope_type": "default", "rope_theta": config.rope_local_theta}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        out.pop("rope_scaling", None)
    return out


def _integral(value: float | None) -> int | float | None:
    """HF's Gemma configs take the scalar as an int (and refuse 256.0)."""
    return int(value) if value is not None and float(value).is_integer() else value


def _read_gguf(field: Field, arch: str, num_layers: int, head_dim: int, tensor=None) -> dict[str, Any]:
    """llama.cpp's Gemma graphs: the window pattern and Gemma 3's local rope base are fixed in code, not metadata."""
    model_type = "gemma2" if arch == "gemma2" else "gemma3_text"
    window = field(f"{arch}.attention.sliding_window")
    window = None if window is None else to_int(window, f"{arch}.attention.sliding_window")
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": float(head_dim),
        "attn_logit_softcapping": _gguf_float(field, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _gguf_float(field, f"{arch}.final_logit_softcapping"),
        "layer_windows": _windows(_SLIDING_EVERY[model_type], window, num_layers),
    }
    if model_type == "gemma3_text":
        out["rope_local_theta"] = _LOCAL_THETA
    return out


def _gguf_float(field: Field, key: str) -> float | None:
    value = field(key)
    return None if value is None else check_float(value, key, 0.0)


def _gemma(model_type: str, hf_class: str, gguf_name: str, qk_norm: str) -> Architecture:
    return Architecture(
        model_type,
        hf_class,
        gguf_name=gguf_name,
        qk_norm=qk_norm,
        norm_offset=1.0,
        sandwich_norms=True,
        scales_embeddings=True,
        default_act="gelu_pytorch_tanh",
        gguf_norm_offset=1.0,
        gguf_layer_names=_GGUF_NAMES,
        read_config=lambda cfg, num_layers: _read(model_type, cfg, num_layers),
        write_config=_write,
        read_gguf=_read_gguf,
    )


GEMMA2 = _gemma("gemma2", "Gemma2ForCausalLM", "gemma2", "")
GEMMA3 = _gemma("gemma3_text", "Gemma3ForCausalLM", "gemma3", "head")
