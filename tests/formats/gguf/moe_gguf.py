"""Write an HF MoE model (Mixtral, Qwen2-MoE, OLMoE) as a GGUF file with gguf-py's GGUFWriter, laid out as llama.cpp's
convert_hf_to_gguf.py lays it out: Mixtral as `llama` with expert counts (LlamaModel, Q/K rows permuted), Qwen2-MoE
as `qwen2moe` (Qwen2MoeModel: expert and shared-expert widths), OLMoE as `olmoe` (OlmoeModel: rms eps written as
1e-5); each layer's experts stacked into one [E, out, in] tensor per projection; routers, norms and 1-D tensors in
F32, the other matrices in `qtype` (convert's --outtype; F32, or a block type through gguf.quants.quantize)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from leanlm.config import ModelConfig
from leanlm.formats.moe_names import to_model_names
from tests.loading.conftest import TINY_MERGES, TINY_TOKENS, llama_cpp_permute

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "olmoe": "olmoe"}
_ATTENTION = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")},
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},  # dense layers (mlp_only_layers)
    **{f"self_attn.{k}.{kind}": f"{v}.{kind}" for k, v in _ATTENTION.items() for kind in ("weight", "bias")},
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
# kept F32 by convert_hf_to_gguf.py whatever --outtype says (llama-quantize skips the router too)
_FLOAT_ONLY = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def gguf_tokens(vocab_size: int) -> list[str]:
    """The tiny byte-level vocabulary, padded as the converter pads a short one: [PAD{i}]."""
    return TINY_TOKENS + [f"[PAD{i}]" for i in range(len(TINY_TOKENS), vocab_size)]


def write_tiny_tokenizer(writer, vocab_size: int) -> None:
    """The tiny byte-level BPE as GGUF tokenizer keys: tokens padded to `vocab_size`, their types, merges, eos."""
    tokens = gguf_tokens(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 5 if t.startswith("[PAD") else 1 for t in tokens])
    writer.add_token_merges(TINY_MERGES)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))


def write_moe_gguf(
    path: Path, hf, qtype: str = "F32", write_norm_key: bool = False, legacy_experts: bool = False
) -> dict[str, torch.Tensor]:
    """Write `hf` (a transformers Mixtral / Qwen2-MoE / OLMoE model) to `path`; return the per-expert HF-named
    float64 state dict the file encodes (the weights after `qtype`'s rounding, un-permuted).

    write_norm_key: also write `{arch}.expert_weights_norm` from norm_topk_prob; the converter does not write it
    for qwen2moe / olmoe (llama.cpp's graphs for them never renormalise), so a norm_topk_prob=true model
    converted as convert does computes other numbers than HF's.
    legacy_experts: one 2-D tensor per expert, blk.N.ffn_{gate,up,down}.E.weight, as the first Mixtral files had."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    arch = GGUF_ARCH[config.architecture]
    state = to_model_names(config, {k: v.detach().float() for k, v in hf.state_dict().items()})
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, hf.config, write_norm_key, qtype)
    block = gguf.GGMLQuantizationType[qtype]
    encoded: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, w: np.ndarray, hf_names: list[str], heads: int = 0) -> None:
        stored = llama_cpp_permute(w, heads) if heads else w
        if block == gguf.GGMLQuantizationType.F32 or stored.ndim == 1 or gguf_name.endswith(_FLOAT_ONLY):
            writer.add_tensor(gguf_name, stored.astype(np.float32))
            back = w.astype(np.float32)
        elif stored.shape[-1] % gguf.GGML_QUANT_SIZES[block][0]:  # rows that are no whole blocks: convert's F16
            writer.add_tensor(gguf_name, stored.astype(np.float16))
            back = w.astype(np.float16)
        else:
            writer.add_tensor(gguf_name, quantize(stored, block), raw_dtype=block)
            back = dequantize(quantize(w, block), block)  # rows quantize alone: the permutation commutes
        for i, name in enumerate(hf_names):
            encoded[name] = torch.from_numpy(np.array(back[i] if len(hf_names) > 1 else back, dtype=np.float64))

    for name, tensor in state.items():
        w = tensor.numpy()
        if name in _GLOBAL:
            add(_GLOBAL[name], w, [name])
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if ".mlp.experts." in name:
            continue  # stacked below, once per layer and projection
        heads = 0
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = config.num_attention_heads if "q_proj" in rest else config.num_key_value_heads
        if rest == "mlp.shared_expert_gate.weight":
            w = w.squeeze(0)  # [1, hidden] -> [hidden], as the converter's squeeze (and llama.cpp's {n_embd}) has it
        add(f"blk.{layer}.{_NAMES[rest]}", w, [name], heads)
        encoded[name] = encoded[name].reshape(tensor.shape)
    for layer in range(config.num_hidden_layers):
        if config.moe.is_sparse(layer):
            for proj in ("gate", "up", "down"):  # convert stacks experts 0..E-1 of each projection: [E, out, in]
                names = [
                    f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight" for e in range(config.moe.num_experts)
                ]
                add(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([state[n].numpy() for n in names]), names)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return encoded


def _write_metadata(writer, config: ModelConfig, hf_config, write_norm_key: bool, qtype: str) -> None:
    """TextModel.set_gguf_parameters and the MoE classes' additions, from the HF config."""
    moe = config.moe
    writer.add_name(f"tiny-{config.architecture}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5 if config.architecture == "olmoe" else config.rms_norm_eps)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if config.architecture == "mixtral":
        writer.add_rope_dimension_count(config.head_dim)  # LlamaModel
    if config.architecture == "qwen2_moe":
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
    if config.clip_qkv is not None:  # convert writes clamp_kqv for OLMo, not OLMoE: without it the file loses the clamp
        writer.add_clamp_kqv(config.clip_qkv)
    if write_norm_key:
        writer.add_expert_weights_norm(bool(getattr(hf_config, "norm_topk_prob", True)))
    import gguf

    file_type = gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"]
    writer.add_file_type(int(file_type))
    write_tiny_tokenizer(writer, config.vocab_size)
