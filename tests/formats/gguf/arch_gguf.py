"""Write an HF Qwen3, Qwen3-MoE, Gemma 2 or Gemma 3 model as a GGUF file with gguf-py's GGUFWriter, as llama.cpp's
convert_hf_to_gguf.py lays them out: no Q/K permutation (their graphs rotate NEOX-style), head_dim as key/value
length, Qwen3's per-head q/k norms as attn_{q,k}_norm, Gemma's norms stored with their +1 folded in and its sandwich
norms as post_attention_norm / ffn_norm / post_ffw_norm, its window and soft-caps as metadata; everything F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from leanlm.config import ModelConfig
from leanlm.formats.moe_names import to_model_names
from tests.formats.gguf.moe_gguf import write_tiny_tokenizer

GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
             "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}  # fmt: skip
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3, fused as HF holds it
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.q_a_proj": "attn_q_a",  # DeepSeek's MLA
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    **{f"mlp.shared_expert.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")},
}
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def write_arch_gguf(path: Path, hf) -> ModelConfig:
    """Write `hf` to `path` (F32); return its config as we read it from HF's."""
    import gguf

    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    arch = GGUF_ARCH[config.architecture]
    gemma = arch.startswith("gemma")
    names = _LAYER | (_GEMMA if gemma else {"post_attention_layernorm": "ffn_norm"})
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    if arch != "phi3":  # Phi-3's files keep its projections fused, as HF's model holds them
        state = to_model_names(config, state)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, config)
    for name, tensor in state.items():
        w = tensor.numpy()
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0  # Gemma's converter folds the norms' +1 in
        if name in _GLOBAL:
            if not (name == "lm_head.weight" and config.tie_word_embeddings):
                writer.add_tensor(_GLOBAL[name], w.astype(np.float32))
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in rest:
            continue
        if kind == "e_score_correction_bias":  # DeepSeek-V3's routing bias
            writer.add_tensor(f"blk.{layer}.exp_probs_b.bias", w.astype(np.float32))
            continue
        writer.add_tensor(f"blk.{layer}.{names[module]}.{kind}", w.astype(np.float32))
        if module == "self_attn.kv_b_proj":  # the converter adds its per-head halves, k_b transposed
            _add_kv_halves(writer, f"blk.{layer}", w, config)
    for layer in range(config.num_hidden_layers):
        if config.moe is not None and config.moe.is_sparse(layer):
            for proj in ("gate", "up", "down"):  # [E, out, in], as convert stacks them
                stacked = [
                    state[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"].numpy()
                    for e in range(config.moe.num_experts)
                ]
                writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack(stacked).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config


def _add_kv_halves(writer, prefix: str, w: np.ndarray, config: ModelConfig) -> None:
    mla, heads = config.mla, config.num_attention_heads
    kv_b = w.reshape(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    k_b = np.ascontiguousarray(kv_b[:, : mla.qk_nope_head_dim].transpose(0, 2, 1))  # [H, L, nope]
    writer.add_tensor(f"{prefix}.attn_k_b.weight", k_b.astype(np.float32))
    writer.add_tensor(
        f"{prefix}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, mla.qk_nope_head_dim :]).astype(np.float32)
    )


def _deepseek_metadata(writer, config: ModelConfig) -> None:
    """DeepseekV2Model.set_gguf_parameters (MLA-era): the latent's widths as key/value length, the heads' as *_mla."""
    mla, moe = config.mla, config.moe
    writer.add_key_length(mla.kv_lora_rank + mla.qk_rope_head_dim)
    writer.add_value_length(mla.kv_lora_rank)
    writer.add_key_length_mla(mla.qk_head_dim)
    writer.add_value_length_mla(mla.v_head_dim)
    writer.add_rope_dimension_count(mla.qk_rope_head_dim)
    if mla.q_lora_rank is not None:
        writer.add_q_lora_rank(mla.q_lora_rank)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    writer.add_leading_dense_block_count(min(moe.sparse_layers or (0,)))
    writer.add_expert_shared_count(moe.shared_expert_intermediate_size // moe.expert_intermediate_size)
    writer.add_expert_weights_scale(moe.routed_scaling_factor)
    writer.add_expert_weights_norm(moe.scoring == "sigmoid_renorm")
    import gguf

    gating = gguf.ExpertGatingFuncType
    writer.add_expert_gating_func(gating.SIGMOID if moe.scoring.startswith("sigmoid") else gating.SOFTMAX)
    writer.add_expert_group_count(moe.num_groups)
    writer.add_expert_group_used_count(moe.topk_groups)
    scaling = config.rope_scaling
    if scaling is not None:
        writer.add_rope_scaling_type(gguf_rope_type("yarn"))
        writer.add_rope_scaling_factor(scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling.mscale_all_dim)


def gguf_rope_type(name: str):
    import gguf

    return gguf.RopeScalingType(name)


def _metadata(writer, config: ModelConfig) -> None:
    import gguf

    writer.add_name(f"tiny-{config.architecture}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if config.architecture == "phi3":  # Phi3MiniModel: the rotary width, LongRoPE's factors as tensors
        writer.add_rope_dimension_count(config.rope_dim)
    elif config.mla is not None:
        _deepseek_metadata(writer, config)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.top_k)
        writer.add_expert_feed_forward_length(config.moe.expert_intermediate_size)
    windows = [w for w in config.layer_windows if w is not None]
    if windows:
        writer.add_sliding_window(windows[0])
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        writer.add_rope_scaling_attn_factors(scaling.magnitude)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
        writer.add_tensor("rope_factors_long.weight", np.array(scaling.long_factor, dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling.short_factor, dtype=np.float32))
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    write_tiny_tokenizer(writer, config.vocab_size)
