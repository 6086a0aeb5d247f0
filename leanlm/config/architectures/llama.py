"""Llama (1-3.x, SmolLM2) and Mistral: the plain pre-norm SwiGLU block every other family is a variation of."""

from leanlm.config.architectures.spec import Architecture


def _write(config) -> dict:
    return {"attention_bias": config.attention_bias, "mlp_bias": False}


LLAMA = Architecture("llama", "LlamaForCausalLM", gguf_name="llama", gguf_permutes_qk=True, write_config=_write)
# llama.cpp writes Mistral files as "llama"; a Mistral config.json differs in its sliding window only
MISTRAL = Architecture("mistral", "MistralForCausalLM", window_every_layer=True)
