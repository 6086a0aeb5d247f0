"""Qwen3: Llama with an RMSNorm over each head's q and k (head_dim wide, shared by the heads) before rotary, and no
q/k/v bias; Qwen3-MoE: that attention with Qwen2-MoE's experts, without the shared one."""

from leanlm.config.architectures.spec import Architecture


def _write(config) -> dict:
    return {"attention_bias": config.attention_bias}


QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", gguf_name="qwen3", qk_norm="head", write_config=_write)
QWEN3_MOE = Architecture(
    "qwen3_moe", "Qwen3MoeForCausalLM", gguf_name="qwen3moe", qk_norm="head", moe="qwen3_moe", write_config=_write
)
