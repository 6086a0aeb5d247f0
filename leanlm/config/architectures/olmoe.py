"""OLMoE: one RMSNorm over every head's q (and k) at once, q/k/v optionally clamped (`clip_qkv`), softmax experts."""

from leanlm.config.architectures.spec import Architecture


def _write(config) -> dict:
    return {"attention_bias": config.attention_bias}


OLMOE = Architecture("olmoe", "OlmoeForCausalLM", gguf_name="olmoe", qk_norm="whole", moe="olmoe", write_config=_write)
