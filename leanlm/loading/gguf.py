"""Read a GGUF file (llama.cpp's format): metadata -> ModelConfig, tensors -> a float HF-named state dict
(and, on request, linears in the block formats our kernels compute on, kept as codes: gguf_codes.py).

Every other quant type is dequantized with `gguf.quants.dequantize`. llama.cpp stores the Q/K rows of *llama*
models (Mixtral included) permuted for its interleaved rotary layout; we undo that so weights match HF's
rotate-half convention. MoE files (Mixtral, Qwen2-MoE, OLMoE: their metadata and [E, ...] expert tensors) are
read through gguf_moe.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tqdm.auto import tqdm

from leanlm.config import ModelConfig
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_codes import CODE_TYPES, runtime_linear
from leanlm.loading.gguf_config import field, gguf_model_config, required
from leanlm.loading.gguf_file import GGUFFile, GGUFTensor, read_gguf
from leanlm.loading.gguf_header import GGUF_MAGIC
from leanlm.loading.gguf_moe import (
    MOE_LAYER_NAMES,
    expert_parts,
    is_expert_tensor,
    legacy_expert_name,
    moe_stored_shape,
)
from leanlm.model.architectures import Architecture
from leanlm.model.linear.base import RuntimeLinear

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **MOE_LAYER_NAMES,
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that carry no weights of their own (llama3 rope factors become RopeScaling instead).
_SKIPPED_TENSORS = ("rope_freqs.weight",)


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The tokenizer a GGUF file describes, under llama.cpp's `tokenizer.ggml.*` keys."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE) are the ones we build
    pre: str  # tokenizer.ggml.pre: which pre-tokenizer split the merges were learned with
    tokens: tuple[str, ...]  # id -> token: gpt2's spelled in the byte-level alphabet, llama's with "▁" for a space
    # id -> llama.cpp type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    token_types: tuple[int, ...]
    scores: tuple[float, ...]  # id -> SentencePiece score (higher merges first); empty when the file has none
    merges: tuple[str, ...]  # "a b" pairs, best first (gpt2); SentencePiece files have none: scores rank merges
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool  # absent: True for "llama" (llama.cpp's and HF's default for SentencePiece), else False
    add_eos_token: bool
    # SentencePiece prepends "▁" to text (and to the text after each control or user-defined token, as llama.cpp
    # does); absent: True for "llama", llama.cpp's default. Byte-level BPE ignores it.
    add_space_prefix: bool
    chat_template: str | None


def is_gguf_file(path: Path) -> bool:
    """True when `path` is a file starting with the GGUF magic (we never trust the extension)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizerMetadata]:
    """Read config, dequantized HF-named state dict and tokenizer metadata from one GGUF file."""
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    state_dict, _ = gguf_state_dict(reader, config, dtype=dtype, progress=progress)
    return config, state_dict, gguf_tokenizer_metadata(reader)


# ---------------------------------------------------------------------------------------------- reading


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file; any problem becomes a ModelLoadError that says what to do."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(
            f"model file {path} does not exist; check the path, or use a bundled model name (see `leanlm models list`)"
        )
    if not is_gguf_file(path):
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf "
            "model file or a Hugging Face model directory with config.json"
        )
    try:
        return read_gguf(path)  # the bounded scan checks every count, length, tensor type and byte range
    except ModelLoadError:
        raise
    except Exception as e:  # what the scan does not model (the big-endian path's GGUFReader, a bad ggml type)
        raise ModelLoadError(
            f"GGUF file {path} has a corrupt or truncated header ({type(e).__name__}: {e}); re-download it, or "
            "re-assemble a bundled model with `leanlm models pull NAME`"
        ) from e


_BLOCKS_PER_CALL = 1 << 16  # bounds the temporaries of one dequantize_blocks call (~2M weights)


def dequantize_tensor(data: np.ndarray, qtype) -> np.ndarray:
    """`gguf.quants.dequantize`, the same function per block, called on large runs of blocks: gguf-py's own
    loop calls it per 16 rows on memmap slices, which made it most of a 0.5B model's load (6 s of 7)."""
    blocks_fn = getattr(getattr(gguf.quants, qtype.name, None), "dequantize_blocks", None)
    if blocks_fn is None or qtype.name in ("F32", "F16", "BF16"):
        return dequantize(data, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data).view(np.uint8).reshape(-1, type_size)  # a plain view: no memmap per slice
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    for start in range(0, blocks.shape[0], _BLOCKS_PER_CALL):
        out[start : start + _BLOCKS_PER_CALL] = blocks_fn(blocks[start : start + _BLOCKS_PER_CALL])
    rows_shape = data.shape[:-1]
    return out.reshape(*rows_shape, data.shape[-1] // type_size * block_size)


def hf_tensor_name(gguf_name: str, arch: Architecture | None = None) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (ModelLoadError when unknown); `arch`'s
    own names (Gemma's sandwich norms) before the Llama ones."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if (expert := legacy_expert_name(gguf_name)) is not None:
        return expert
    names = _LAYER_NAMES if arch is None else _LAYER_NAMES | arch.gguf_layer_names
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        what = "a llama-family" if arch is None else f"a {arch.model_type}"
        raise ModelLoadError(
            f"GGUF tensor {gguf_name!r} is not part of {what} model as llama.cpp writes it; the file holds an "
            "architecture or variant we do not support"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows [x0 y0 x1 y1 ...] -> [x0 x1 ... y0 y1 ...].

    w: [H * D, in] weight or [H * D] bias. llama.cpp's converter did reshape(H, 2, D/2).swapaxes(1, 2);
    this is its inverse, which gives the rotate-half layout HF's LlamaAttention expects.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensor_parts(tensor: GGUFTensor, config: ModelConfig) -> list[tuple[str, np.ndarray, tuple[int, ...]]]:
    """(HF name, data, [out, in] or [n]) of each weight a GGUF tensor holds: one, or E for an expert tensor."""
    stored = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if is_expert_tensor(tensor.name):
        return expert_parts(tensor.name, stored, tensor.data, config)
    name = hf_tensor_name(tensor.name, config.arch)
    expected = config.tensor_shape(name)
    # The metadata and the tensor infos must agree before Q/K un-permutation reshapes by head count.
    if moe_stored_shape(name, stored, expected) != expected:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} has shape {list(stored)}, but the metadata describes "
            f"{list(expected)}; the file is corrupt, re-download it"
        )
    return [(name, tensor.data, expected)]


def gguf_state_dict(
    reader: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    keep_codes: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, RuntimeLinear]]:
    """Every tensor under its HF name, in HF's [out, in] layout (a layer's [E, out, in] expert tensor as E
    per-expert weights): dequantized to `dtype`, except, with `keep_codes`, linears in a block format the kernels
    compute on (gguf_codes.CODE_TYPES), which come back as runtime layers by module name. The embedding is a
    lookup table and always dequantized; a tied head in such a format comes back as an "lm_head" layer on the
    embedding's codes (the caller unties the config). Routers stay float: they are no linear layer."""
    state_dict: dict[str, torch.Tensor] = {}
    coded: dict[str, tuple] = {}  # module name -> runtime_linear's arguments, built once the biases are read
    tensors = [t for t in reader.tensors if t.name not in _SKIPPED_TENSORS]
    for tensor in tqdm(tensors, desc="loading GGUF tensors", unit="tensor", disable=not progress):
        for name, data, expected in _tensor_parts(tensor, config):
            heads = None
            if config.arch.gguf_permutes_qk and (".q_proj." in name or ".k_proj." in name):
                heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            if keep_codes and tensor.tensor_type in CODE_TYPES and _is_linear_weight(name):
                if name == "model.embed_tokens.weight":  # a lookup table: dequantized below; as the tied head, codes
                    if config.tie_word_embeddings:
                        coded["lm_head"] = (tensor.tensor_type, data, expected, None)
                else:
                    row_order = None if heads is None else unpermute_rotary(torch.arange(expected[0]), heads)
                    coded[name.removesuffix(".weight")] = (tensor.tensor_type, data, expected, row_order)
                    continue
            weight = _dequantized(tensor, data, expected, heads)
            if config.arch.gguf_norm_offset and name.endswith("norm.weight"):  # llama.cpp folded Gemma's +1 in
                weight = weight - config.arch.gguf_norm_offset
            state_dict[name] = weight.to(dtype).contiguous()
    # a bias (qwen2's q/k/v) stays float, on the runtime layer
    quantized = {m: runtime_linear(*args, bias=state_dict.pop(m + ".bias", None)) for m, args in coded.items()}
    return state_dict, quantized


def _is_linear_weight(name: str) -> bool:
    """A weight that becomes a runtime linear: not a bias, a norm, the router or the shared expert's gate."""
    return name.endswith(".weight") and not name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight"))


def _dequantized(tensor: GGUFTensor, data: np.ndarray, expected: tuple[int, ...], heads: int | None) -> torch.Tensor:
    try:
        # dequantize returns numpy in row-major [out, in] order: GGUF lists dims innermost first.
        array = dequantize_tensor(data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(
            f"cannot dequantize GGUF tensor {tensor.name} of type {tensor.tensor_type.name}: {e}"
        ) from e
    weight = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))  # memmapped F32 is read-only: copy
    weight = weight.reshape(expected)
    return weight if heads is None else unpermute_rotary(weight, heads)


# ---------------------------------------------------------------------------------------------- tokenizer


def gguf_tokenizer_metadata(reader: GGUFFile) -> GGUFTokenizerMetadata:
    """Collect the `tokenizer.*` keys the Tokenizer is built from."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = field(reader, "tokenizer.ggml.scores") or []
    _check_per_token("tokenizer.ggml.token_type", types, len(tokens))
    if scores:
        _check_per_token("tokenizer.ggml.scores", scores, len(tokens))
    model = str(required(reader, "tokenizer.ggml.model"))
    is_spm = model == "llama"

    def optional_id(key: str) -> int | None:
        value = field(reader, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return GGUFTokenizerMetadata(
        model=model,
        pre=str(field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in types),
        scores=tuple(float(s) for s in scores),
        merges=tuple(field(reader, "tokenizer.ggml.merges") or ()),
        bos_token_id=optional_id("bos_token_id"),
        eos_token_id=optional_id("eos_token_id"),
        unk_token_id=optional_id("unknown_token_id"),
        pad_token_id=optional_id("padding_token_id"),
        add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", is_spm)),
        add_eos_token=bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(field(reader, "tokenizer.ggml.add_space_prefix", is_spm)),
        chat_template=field(reader, "tokenizer.chat_template"),
    )


def _check_per_token(key: str, values: object, num_tokens: int) -> None:
    """A per-token array must have one entry per token: one of another length would pair tokens with the wrong type
    or score, silently."""
    if not isinstance(values, list) or len(values) != num_tokens:
        got = f"{len(values)} entries" if isinstance(values, list) else f"a {type(values).__name__}"
        raise ModelLoadError(
            f"GGUF metadata {key} has {got} but tokenizer.ggml.tokens has {num_tokens}; it needs one per token: "
            "the file is damaged or was written by a broken converter, re-download or re-convert it"
        )
