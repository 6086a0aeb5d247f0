"""GGUF metadata -> ModelConfig: `general.*`, `{arch}.*` and `tokenizer.ggml.*` keys, each checked for kind and range
(leanlm.config.values), a missing or bad one a ModelLoadError naming the key; the layer count against the tensors the
file holds before anything is built; llama3 rope factors checked against the ones the metadata implies."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from leanlm.config import ModelConfig, RopeScaling
from leanlm.config.architectures import get_architecture
from leanlm.config.values import check_float, to_int
from leanlm.formats.gguf.moe import gguf_moe_config, moe_architecture, moe_config_fields
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_file import GGUFFile
from leanlm.loading.tokenizer import END_OF_TURN_TOKENS

BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def required(reader: GGUFFile, key: str) -> Any:
    value = field(reader, key)
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
    arch = required(reader, "general.architecture")  # GGUF's name: the prefix of its keys
    if not isinstance(arch, str):
        raise ValueError(f"general.architecture must be a string, got {arch!r}")
    architecture = moe_architecture(arch, reader.fields.get)  # ours
    tensor_names = {t.name for t in reader.tensors}
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    if not isinstance(tokens, list):
        raise ValueError(f"tokenizer.ggml.tokens must be an array of strings, got {type(tokens).__name__}")
    hidden = to_int(required(reader, f"{arch}.embedding_length"), f"{arch}.embedding_length")
    num_heads = to_int(required(reader, f"{arch}.attention.head_count"), f"{arch}.attention.head_count")
    num_layers = to_int(required(reader, f"{arch}.block_count"), f"{arch}.block_count")
    # Before anything is built (or walked) per layer: a block_count of 1e6 over a 2-layer file built a million
    # layers before any tensor was compared.
    held = 1 + max((int(m.group(1)) for n in tensor_names if (m := BLOCK_INDEX.match(n))), default=-1)
    if num_layers != held:
        raise ModelLoadError(
            f"GGUF metadata {arch}.block_count is {num_layers}, but the file holds tensors of {held} layers "
            "(blk.0 .. blk.N); the file is damaged or was edited: re-download it"
        )
    # `x or y` would read a 0 as "absent" and pass over it: an explicit value is checked, whatever it is
    head_dim_key = next(
        (k for k in (f"{arch}.rope.dimension_count", f"{arch}.attention.key_length") if field(reader, k) is not None),
        None,
    )
    head_dim = None if head_dim_key is None else field(reader, head_dim_key)
    if head_dim is None and hidden % num_heads:
        raise ValueError(
            f"{arch}.embedding_length ({hidden}) is not a multiple of {arch}.attention.head_count ({num_heads}) "
            "and the file gives no rope.dimension_count"
        )
    vocab_size = field(reader, f"{arch}.vocab_size", len(tokens))
    if vocab_size == 0 and not tokens:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor a token list; the file is corrupt")
    # DeepSeek's routing (sigmoid, groups, scaled weights) is its architecture's to read (read_gguf below)
    own_moe = get_architecture(architecture).moe == "deepseek"
    moe = None if own_moe else gguf_moe_config(arch, reader.fields.get, tensor_names, num_layers)
    if architecture == "mixtral" and moe.sparse_layers is not None:  # llama.cpp runs a dense MLP where no router is;
        architecture = "llama"  # HF's Mixtral cannot, so it is a llama model with a leanlm_moe block
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    head_dim = hidden // num_heads if head_dim is None else to_int(head_dim, head_dim_key)
    own = get_architecture(architecture).read_gguf
    extra = {} if own is None else own(reader.fields.get, arch, num_layers, head_dim, _tensor_values(reader))
    fields = dict(
        architecture=architecture,
        vocab_size=to_int(vocab_size, f"{arch}.vocab_size"),
        hidden_size=hidden,
        intermediate_size=to_int(required(reader, f"{arch}.feed_forward_length"), f"{arch}.feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=to_int(
            field(reader, f"{arch}.attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv"
        ),
        head_dim=head_dim,
        max_position_embeddings=to_int(
            required(reader, f"{arch}.context_length"), f"{arch}.context_length", maximum=1 << 64
        ),
        rms_norm_eps=check_float(
            required(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
            f"{arch}.attention.layer_norm_rms_epsilon",
            0.0,
            1.0,
        ),
        rope_theta=check_float(field(reader, f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base", 0.0),
        rope_scaling=None if own_moe else _rope_scaling(reader, arch),  # DeepSeek's YaRN: its read_gguf
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else to_int(bos, "tokenizer.ggml.bos_token_id", minimum=0),
        eos_token_ids=_eos_token_ids(field(reader, "tokenizer.ggml.eos_token_id"), tokens),
        name=str(field(reader, "general.name", "")),
        moe=moe,
        **moe_config_fields(arch, reader.fields.get),
    )
    return ModelConfig(**(fields | extra))  # the architecture's own reading wins


def _tensor_values(reader: GGUFFile):
    """name -> a float32 tensor's values as a float64 array (None when absent or not float32): the rope factor tensors
    some converters write in place of metadata."""

    def values(name: str) -> np.ndarray | None:
        found = next((t for t in reader.tensors if t.name == name), None)
        if found is None or found.tensor_type.name != "F32":
            return None
        return np.asarray(found.data, dtype=np.float64).reshape(-1)

    return values


def _eos_token_ids(eos_token_id: int | None, tokens: list[str]) -> tuple[int, ...]:
    """The declared eos first, then every end-of-turn token the vocabulary has (deduplicated)."""
    ids = [] if eos_token_id is None else [to_int(eos_token_id, "tokenizer.ggml.eos_token_id", minimum=0)]
    index = {tok: i for i, tok in enumerate(tokens) if tok in END_OF_TURN_TOKENS}
    ids += [index[tok] for tok in END_OF_TURN_TOKENS if tok in index]
    return tuple(dict.fromkeys(ids))


def _rope_scaling(reader: GGUFFile, arch: str) -> RopeScaling | None:
    """'linear' from `{arch}.rope.scaling.*`; llama3 scaling is recovered from the `rope_freqs` tensor."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    orig_ctx = to_int(
        field(reader, f"{arch}.rope.scaling.original_context_length", 8192),
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
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
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
