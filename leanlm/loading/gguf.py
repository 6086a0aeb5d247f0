"""Read a GGUF file (llama.cpp's format): metadata -> ModelConfig, tensors -> a float HF-named state dict
(and, on request, linears in the block formats our kernels compute on, kept as codes: gguf_codes.py).

Every other quant type is dequantized with `gguf.quants.dequantize`. llama.cpp stores the Q/K rows of *llama*
models (Mixtral included) permuted for its interleaved rotary layout; we undo that so weights match HF's
rotate-half convention. MoE files (Mixtral, Qwen2-MoE, OLMoE: their metadata and [E, ...] expert tensors) are
read through gguf_moe.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tqdm.auto import tqdm

from leanlm.config import ModelConfig, RopeScaling
from leanlm.config.values import check_float, to_int
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_codes import CODE_TYPES, runtime_linear
from leanlm.loading.gguf_file import GGUFFile, GGUFTensor, read_gguf
from leanlm.loading.gguf_header import GGUF_MAGIC
from leanlm.loading.gguf_moe import (
    MOE_LAYER_NAMES,
    expert_parts,
    gguf_moe_config,
    is_expert_tensor,
    legacy_expert_name,
    moe_architecture,
    moe_config_fields,
    moe_stored_shape,
)
from leanlm.model.linear.base import RuntimeLinear

# Tokens that end a chat turn in the families we support; added to eos_token_ids when present.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")

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
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")
# Tensors that carry no weights of their own (llama3 rope factors become RopeScaling instead).
_SKIPPED_TENSORS = ("rope_freqs.weight",)
# llama.cpp's LlamaModel converter (which converts Mixtral too) permutes Q/K rows for its interleaved rotary;
# qwen2, qwen2moe and olmoe use the NEOX (rotate-half) layout and are written as they are.
_PERMUTED_ARCHITECTURES = ("llama", "mixtral")


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The tokenizer a GGUF file describes, under llama.cpp's `tokenizer.ggml.*` keys."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) is the one we build
    pre: str  # tokenizer.ggml.pre: which pre-tokenizer split the merges were learned with
    tokens: tuple[str, ...]  # id -> token, spelled in the byte-level alphabet
    token_types: tuple[int, ...]  # id -> llama.cpp type: 1 normal, 3 control, 4 user-defined, ...
    merges: tuple[str, ...]  # "a b" pairs, best first
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
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


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def _required(reader: GGUFFile, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata is missing {key!r}; the file is not a complete model, re-download it")
    return value


# ---------------------------------------------------------------------------------------------- config


def gguf_model_config(reader: GGUFFile) -> ModelConfig:
    """Build the ModelConfig from `general.*`, `{arch}.*` and `tokenizer.ggml.*` metadata. Every value is checked for
    its kind and range, and the layer count against the tensors the file holds, before anything is sized from it:
    a ModelLoadError names the key."""
    try:
        return _model_config(reader)
    except ModelLoadError:
        raise
    except ValueError as e:  # a metadata value of the wrong kind, or ModelConfig's validation
        raise ModelLoadError(
            f"GGUF metadata describes an invalid model: {e}; the file is damaged: re-download it"
        ) from e


def _model_config(reader: GGUFFile) -> ModelConfig:
    arch = _required(reader, "general.architecture")  # GGUF's name: the prefix of its keys
    if not isinstance(arch, str):
        raise ValueError(f"general.architecture must be a string, got {arch!r}")
    architecture = moe_architecture(arch, reader.fields.get)  # ours
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    if not isinstance(tokens, list):
        raise ValueError(f"tokenizer.ggml.tokens must be an array of strings, got {type(tokens).__name__}")
    hidden = to_int(_required(reader, f"{arch}.embedding_length"), f"{arch}.embedding_length")
    num_heads = to_int(_required(reader, f"{arch}.attention.head_count"), f"{arch}.attention.head_count")
    num_layers = to_int(_required(reader, f"{arch}.block_count"), f"{arch}.block_count")
    # Before anything is built (or walked) per layer: a block_count of 1e6 over a 2-layer file built a million
    # layers before any tensor was compared.
    held = 1 + max((int(m.group(1)) for n in tensor_names if (m := _BLOCK_INDEX.match(n))), default=-1)
    if num_layers != held:
        raise ModelLoadError(
            f"GGUF metadata {arch}.block_count is {num_layers}, but the file holds tensors of {held} layers "
            "(blk.0 .. blk.N); the file is damaged or was edited: re-download it"
        )
    # `x or y` would read a 0 as "absent" and pass over it: an explicit value is checked, whatever it is
    head_dim_key = next(
        (k for k in (f"{arch}.rope.dimension_count", f"{arch}.attention.key_length") if _field(reader, k) is not None),
        None,
    )
    head_dim = None if head_dim_key is None else _field(reader, head_dim_key)
    if head_dim is None and hidden % num_heads:
        raise ValueError(
            f"{arch}.embedding_length ({hidden}) is not a multiple of {arch}.attention.head_count ({num_heads}) "
            "and the file gives no rope.dimension_count"
        )
    vocab_size = _field(reader, f"{arch}.vocab_size", len(tokens))
    if vocab_size == 0 and not tokens:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor a token list; the file is corrupt")
    moe = gguf_moe_config(arch, reader.fields.get, tensor_names, num_layers)
    if architecture == "mixtral" and moe.sparse_layers is not None:  # llama.cpp runs a dense MLP where no router is;
        architecture = "llama"  # HF's Mixtral cannot, so it is a llama model with a leanlm_moe block
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=to_int(vocab_size, f"{arch}.vocab_size"),
        hidden_size=hidden,
        intermediate_size=to_int(_required(reader, f"{arch}.feed_forward_length"), f"{arch}.feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=to_int(
            _field(reader, f"{arch}.attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv"
        ),
        head_dim=hidden // num_heads if head_dim is None else to_int(head_dim, head_dim_key),
        max_position_embeddings=to_int(
            _required(reader, f"{arch}.context_length"), f"{arch}.context_length", maximum=1 << 64
        ),
        rms_norm_eps=check_float(
            _required(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
            f"{arch}.attention.layer_norm_rms_epsilon",
            0.0,
            1.0,
        ),
        rope_theta=check_float(_field(reader, f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base", 0.0),
        rope_scaling=_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else to_int(bos, "tokenizer.ggml.bos_token_id", minimum=0),
        eos_token_ids=_eos_token_ids(_field(reader, "tokenizer.ggml.eos_token_id"), tokens),
        name=str(_field(reader, "general.name", "")),
        moe=moe,
        **moe_config_fields(arch, reader.fields.get),
    )


def _eos_token_ids(eos_token_id: int | None, tokens: list[str]) -> tuple[int, ...]:
    """The declared eos first, then every end-of-turn token the vocabulary has (deduplicated)."""
    ids = [] if eos_token_id is None else [to_int(eos_token_id, "tokenizer.ggml.eos_token_id", minimum=0)]
    index = {tok: i for i, tok in enumerate(tokens) if tok in END_OF_TURN_TOKENS}
    ids += [index[tok] for tok in END_OF_TURN_TOKENS if tok in index]
    return tuple(dict.fromkeys(ids))


def _rope_scaling(reader: GGUFFile, arch: str) -> RopeScaling | None:
    """'linear' from `{arch}.rope.scaling.*`; llama3 scaling is recovered from the `rope_freqs` tensor."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    orig_ctx = to_int(
        _field(reader, f"{arch}.rope.scaling.original_context_length", 8192),
        f"{arch}.rope.scaling.original_context_length",
    )
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return _llama3_scaling(np.asarray(freqs.data, dtype=np.float64), reader, arch, orig_ctx)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind != "linear":
        raise ModelLoadError(
            f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (only 'linear' and llama3's rope_freqs tensor)"
        )
    return RopeScaling(rope_type="linear", factor=check_float(factor, f"{arch}.rope.scaling.factor", 0.0))


def _llama3_scaling(stored: np.ndarray, reader: GGUFFile, arch: str, orig_ctx: int) -> RopeScaling:
    """llama.cpp stores the per-frequency divisors; fit factor (its max) and check Llama 3's default shape."""
    scaling = RopeScaling(rope_type="llama3", factor=float(stored.max()), original_max_position_embeddings=orig_ctx)
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    dim = 2 * stored.size
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * math.pi / inv_freq
    low_wl = orig_ctx / scaling.low_freq_factor
    high_wl = orig_ctx / scaling.high_freq_factor
    smooth = (orig_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    expected = np.where(
        wavelen < high_wl,
        1.0,
        np.where(wavelen > low_wl, scaling.factor, 1.0 / ((1 - smooth) / scaling.factor + smooth)),
    )
    if not np.allclose(expected, stored, rtol=1e-3):
        raise ModelLoadError(
            "GGUF rope_freqs tensor does not match Llama 3 scaling with low/high frequency "
            "factors 1/4; this rope scaling variant is not supported"
        )
    return scaling


# ---------------------------------------------------------------------------------------------- tensors


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


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (ModelLoadError when unknown)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if (expert := legacy_expert_name(gguf_name)) is not None:
        return expert
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(
            f"GGUF tensor {gguf_name!r} is not part of a llama, qwen2, mixtral, qwen2moe or olmoe model; the file "
            "holds an architecture we do not support"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


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
    name = hf_tensor_name(tensor.name)
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
            if config.architecture in _PERMUTED_ARCHITECTURES and (".q_proj." in name or ".k_proj." in name):
                heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            if keep_codes and tensor.tensor_type in CODE_TYPES and _is_linear_weight(name):
                if name == "model.embed_tokens.weight":  # a lookup table: dequantized below; as the tied head, codes
                    if config.tie_word_embeddings:
                        coded["lm_head"] = (tensor.tensor_type, data, expected, None)
                else:
                    row_order = None if heads is None else unpermute_rotary(torch.arange(expected[0]), heads)
                    coded[name.removesuffix(".weight")] = (tensor.tensor_type, data, expected, row_order)
                    continue
            state_dict[name] = _dequantized(tensor, data, expected, heads).to(dtype).contiguous()
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
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    def optional_id(key: str) -> int | None:
        value = _field(reader, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return GGUFTokenizerMetadata(
        model=str(_required(reader, "tokenizer.ggml.model")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in types),
        merges=tuple(_field(reader, "tokenizer.ggml.merges") or ()),
        bos_token_id=optional_id("bos_token_id"),
        eos_token_id=optional_id("eos_token_id"),
        unk_token_id=optional_id("unknown_token_id"),
        pad_token_id=optional_id("padding_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
