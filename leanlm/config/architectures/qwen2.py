"""Qwen2 / Qwen2.5: Llama with q/k/v biases; Qwen2-MoE: its experts plus a gated shared expert."""

from leanlm.config.architectures.spec import Architecture


def _write_moe(config) -> dict:
    return {"qkv_bias": config.attention_bias}


QWEN2 = Architecture("qwen2", "Qwen2ForCausalLM", gguf_name="qwen2", qkv_bias=True)
QWEN2_MOE = Architecture(
    "qwen2_moe", "Qwen2MoeForCausalLM", gguf_name="qwen2moe", qkv_bias=True, moe="qwen2_moe", write_config=_write_moe
)
