"""Mixtral: Llama's block with a sparse MLP of renormalised top-k experts; its files name experts
`block_sparse_moe.experts.{e}.w1|w3|w2` (leanlm.formats.moe_names maps them). llama.cpp writes it as a llama file
with `llama.expert_count` (leanlm.formats.gguf.moe)."""

from leanlm.config.architectures.spec import Architecture

MIXTRAL = Architecture("mixtral", "MixtralForCausalLM", gguf_permutes_qk=True, moe="mixtral", window_every_layer=True)
