"""DeepSeek-V2 / V3: multi-head latent attention (leanlm.config.mla: the cache holds a latent, not per-head K/V) and
DeepSeekMoE: fine-grained routed experts plus always-on shared experts, after first_k_dense_replace dense layers;
V2 scores by softmax (group-limited greedy where its topk_method says), V3 by sigmoid with a learned per-expert bias
for choosing and groups of experts; both scale the chosen weights by routed_scaling_factor. Their files name the
shared experts `mlp.shared_experts` (the model's `mlp.shared_expert`, as Qwen2-MoE's)."""

from __future__ import annotations

import re
from typing import Any

from leanlm.config.values import check_bool, check_float, optional, required, to_int
from leanlm.model.architectures.spec import Architecture

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


def _deepseek(model_type: str, hf_class: str) -> Architecture:
    return Architecture(
        model_type,
        hf_class,
        moe="deepseek",
        read_config=lambda cfg, num_layers: _read(model_type, cfg, num_layers),
        write_config=_write,
        to_model_names=_rename(_SHARED_FILE, "shared_expert."),
        to_file_names=_rename(_SHARED_MODEL, "shared_experts."),
    )


DEEPSEEK_V2 = _deepseek("deepseek_v2", "DeepseekV2ForCausalLM")
DEEPSEEK_V3 = _deepseek("deepseek_v3", "DeepseekV3ForCausalLM")
