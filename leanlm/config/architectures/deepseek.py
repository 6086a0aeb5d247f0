"""DeepSeek-V2 / V3: multi-head latent attention (leanlm.config.mla: the cache holds a latent, not per-head K/V) and
DeepSeekMoE: fine-grained routed experts plus always-on shared experts, after first_k_dense_replace dense layers;
V2 scores by softmax (group-limited greedy where its topk_method says), V3 by sigmoid with a learned per-expert bias
for choosing and groups of experts; both scale the chosen weights by routed_scaling_factor. Their files name the
shared experts `mlp.shared_experts` (the model's `mlp.shared_expert`, as Qwen2-MoE's)."""

from __future__ import annotations

import re
from typing import Any

from leanlm.config.architectures.spec import Architecture
from leanlm.config.values import check_bool, check_float, optional, required, to_int

_SHARED_FILE = re.compile(r"(model\.layers\.\d+\.mlp\.)shared_experts\.")
_SHARED_MODEL = re.compile(r"(model\.layers\.\d+\.mlp\.)shared_expert\.")


def _read(model_type: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    from leanlm.config.mla import MLAConfig
    from leanlm.config.moe import MoEConfig

    q_rank = cfg.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=to_int(required(cfg, "kv_lora_rank"), "kv_lora_rank"),
        qk_nope_head_dim=to_int(required(cfg, "qk_nope_head_dim"), "qk_nope_head_dim"),
        qk_rope_head_dim=to_int(required(cfg, "qk_rope_head_dim"), "qk_rope_head_dim"),
        v_head_dim=to_int(required(cfg, "v_head_dim"), "v_head_dim"),
        q_lora_rank=None if q_rank is None else to_int(q_rank, "q_lora_rank"),
        rope_interleave=check_bool(optional(cfg, "rope_interleave", True), "rope_interleave"),
    )
    out: dict[str, Any] = {"mla": mla, "head_dim": mla.qk_head_dim, "num_key_value_heads": cfg["num_attention_heads"]}
    experts = to_int(optional(cfg, "n_routed_experts", 0), "n_routed_experts", minimum=0)
    if not experts:
        return out
    dense = to_int(optional(cfg, "first_k_dense_replace", 0), "first_k_dense_replace", minimum=0)
    every = to_int(optional(cfg, "moe_layer_freq", 1), "moe_layer_freq")
    sparse = tuple(i for i in range(dense, num_layers) if i % every == 0)
    width = to_int(required(cfg, "moe_intermediate_size"), "moe_intermediate_size")
    v3 = model_type == "deepseek_v3"
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    renorm = check_bool(optional(cfg, "norm_topk_prob", False), "norm_topk_prob")
    out["moe"] = MoEConfig(
        num_experts=experts,
        top_k=to_int(required(cfg, "num_experts_per_tok"), "num_experts_per_tok"),
        expert_intermediate_size=width,
        # HF's V2 router never renormalises, whatever norm_topk_prob says
        scoring=("sigmoid_renorm" if renorm else "sigmoid") if v3 else "softmax",
        shared_expert_intermediate_size=width * to_int(optional(cfg, "n_shared_experts", 0), "n_shared_experts", 0),
        sparse_layers=None if len(sparse) == num_layers else sparse,
        num_groups=to_int(optional(cfg, "n_group", 1), "n_group") if grouped else 1,
        topk_groups=to_int(optional(cfg, "topk_group", 1), "topk_group") if grouped else 1,
        routed_scaling_factor=check_float(optional(cfg, "routed_scaling_factor", 1.0), "routed_scaling_factor", 0.0),
        score_bias=v3,
    )
    return out


def _write(config) -> dict[str, Any]:
    mla, moe = config.mla, config.moe
    out: dict[str, Any] = {
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,  # HF's configs name the rotary width so
        "attention_bias": config.attention_bias,
    }
    if config.architecture == "deepseek_v3":
        out["rope_interleave"] = mla.rope_interleave
    if moe is None:
        return out | {"n_routed_experts": 0 if config.architecture == "deepseek_v3" else None}
    sparse = range(config.num_hidden_layers) if moe.sparse_layers is None else moe.sparse_layers
    first = min(sparse, default=config.num_hidden_layers)
    if list(sparse) != list(range(first, config.num_hidden_layers)):
        raise ValueError(f"a DeepSeek config expresses experts from one layer on, not in layers {list(sparse)}")
    out |= {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_shared_experts": moe.shared_expert_intermediate_size // moe.expert_intermediate_size,
        "first_k_dense_replace": first,
        "n_group": moe.num_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.scoring == "sigmoid_renorm",
    }
    if config.architecture == "deepseek_v2":
        out["topk_method"] = "group_limited_greedy" if moe.num_groups > 1 else "greedy"
    return out


def _rename(pattern: re.Pattern, new: str):
    def rename(config, state_dict):
        return {pattern.sub(lambda m: m.group(1) + new, k): v for k, v in state_dict.items()}

    return rename


def _to_model_names(config, state_dict):
    """Files' shared_experts -> the model's shared_expert; GGUF's exp_probs_b (read as mlp.gate.bias) -> V3's bias."""
    renamed = _rename(_SHARED_FILE, "shared_expert.")(config, state_dict)
    return {_GGUF_BIAS.sub(r"\1e_score_correction_bias", k): v for k, v in renamed.items()}


# llama.cpp's deepseek2 tensors (after "blk.N."), beyond the Llama ones
_GGUF_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "exp_probs_b": "mlp.gate",  # its .bias: V3's e_score_correction_bias
}
_GGUF_BIAS = re.compile(r"(model\.layers\.\d+\.mlp\.gate\.)bias$")


def _read_gguf(field, arch: str, num_layers: int, head_dim: int, tensor) -> dict[str, Any]:
    """llama.cpp's deepseek2 metadata (V2 and V3 alike): MLA's ranks and widths (key/value_length_mla where the
    converter writes the latent's as key/value_length), DeepSeekMoE's counts, gating (1 softmax, 2 sigmoid), groups
    and scale, YaRN."""
    from leanlm.config.mla import MLAConfig
    from leanlm.config.moe import MoEConfig
    from leanlm.config.rope import RopeScaling

    def count(key: str, default: int | None = None, minimum: int = 1) -> int:
        value = field(f"{arch}.{key}")
        if value is None and default is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return to_int(default if value is None else value, f"{arch}.{key}", minimum=minimum)

    rope = count("rope.dimension_count")
    mla_key = field(f"{arch}.attention.key_length_mla")
    key = count("attention.key_length_mla") if mla_key is not None else count("attention.key_length")
    value = count("attention.value_length_mla" if mla_key is not None else "attention.value_length")
    q_rank = count("attention.q_lora_rank", 0, minimum=0)
    mla = MLAConfig(
        kv_lora_rank=count("attention.kv_lora_rank"),
        qk_nope_head_dim=key - rope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
        q_lora_rank=q_rank or None,
        rope_interleave=True,  # llama.cpp rotates deepseek2 in pairs (its NORM rope), on HF's layout
    )
    heads = count("attention.head_count")
    out: dict[str, Any] = {"mla": mla, "head_dim": mla.qk_head_dim, "num_key_value_heads": heads}
    experts = count("expert_count", 0, minimum=0)
    if experts:
        dense = count("leading_dense_block_count", 0, minimum=0)
        width = count("expert_feed_forward_length")
        sigmoid = count("expert_gating_func", 1) == 2
        renorm = check_bool(field(f"{arch}.expert_weights_norm") or False, f"{arch}.expert_weights_norm")
        groups = count("expert_group_count", 1)
        out["moe"] = MoEConfig(
            num_experts=experts,
            top_k=count("expert_used_count"),
            expert_intermediate_size=width,
            scoring=("sigmoid_renorm" if renorm else "sigmoid") if sigmoid else "softmax",
            shared_expert_intermediate_size=width * count("expert_shared_count", 0, minimum=0),
            sparse_layers=None if dense == 0 else tuple(range(dense, num_layers)),
            num_groups=groups,
            topk_groups=count("expert_group_used_count", 1),
            routed_scaling_factor=check_float(
                field(f"{arch}.expert_weights_scale") or 1.0, "expert_weights_scale", 0.0
            ),
            score_bias=tensor(f"blk.{dense}.exp_probs_b.bias") is not None,  # V3's routing bias
        )
        # llama.cpp names V2 and V3 alike; V3 is the one that gates by sigmoid (and saves as HF's V3 class)
        out["architecture"] = "deepseek_v3" if sigmoid else "deepseek_v2"
    if field(f"{arch}.rope.scaling.type") == "yarn":
        log_mul = check_float(
            field(f"{arch}.rope.scaling.yarn_log_multiplier") or 0.0, "yarn_log_multiplier", 0.0, open_minimum=False
        )
        out["rope_scaling"] = RopeScaling(
            rope_type="yarn",
            factor=check_float(field(f"{arch}.rope.scaling.factor"), f"{arch}.rope.scaling.factor", 0.0),
            original_max_position_embeddings=count("rope.scaling.original_context_length"),
            # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs set mscale to the same value
            mscale=log_mul / 0.1,
            mscale_all_dim=log_mul / 0.1,
        )
    return out


def _deepseek(model_type: str, hf_class: str) -> Architecture:
    return Architecture(
        model_type,
        hf_class,
        gguf_name="deepseek2" if model_type == "deepseek_v3" else "",
        gguf_layer_names=_GGUF_NAMES,
        gguf_skipped=("attn_k_b.weight", "attn_v_b.weight"),
        read_gguf=_read_gguf,
        moe="deepseek",
        read_config=lambda cfg, num_layers: _read(model_type, cfg, num_layers),
        write_config=_write,
        to_model_names=_to_model_names,
        to_file_names=_rename(_SHARED_MODEL, "shared_experts."),
    )


DEEPSEEK_V2 = _deepseek("deepseek_v2", "DeepseekV2ForCausalLM")
DEEPSEEK_V3 = _deepseek("deepseek_v3", "DeepseekV3ForCausalLM")
