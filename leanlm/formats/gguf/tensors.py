"""GGUF tensors -> a float HF-named state dict (and, on request, linears in the block formats our kernels compute on,
kept as codes: codes.py). Every other quant type is dequantized with `gguf.quants.dequantize`. llama.cpp stores the
Q/K rows of *llama* models (Mixtral included) permuted for its interleaved rotary layout; we undo that so weights match
HF's rotate-half convention. MoE expert tensors are read through moe.py."""

from __future__ import annotations

import re

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize
from tqdm.auto import tqdm

from leanlm.config import ModelConfig
from leanlm.config.architectures import Architecture
from leanlm.formats.gguf.codes import CODE_TYPES, runtime_linear
from leanlm.formats.gguf.moe import (
    MOE_LAYER_NAMES,
    expert_parts,
    is_expert_tensor,
    legacy_expert_name,
    moe_stored_shape,
)
from leanlm.formats.load_slice import Cut, LoadSlice, own
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_file import GGUFFile, GGUFTensor
from leanlm.model.linear.base import RuntimeLinear
from leanlm.model.linear.shard import COLUMN
from leanlm.model.offload import return_freed_memory

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
_SKIPPED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# fused projections (Phi-3's attn_qkv, its gate + up ffn_up): dequantized, then split by the architecture's name map
_FUSED = (".qkv_proj.", ".gate_up_proj.")


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
    dequantize_gguf: bool = True,
    keep: LoadSlice | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, RuntimeLinear]]:
    """Every tensor under its HF name, in HF's [out, in] layout (a layer's [E, out, in] expert tensor as E
    per-expert weights): dequantized to `dtype`, except, unless `dequantize_gguf`, linears in a block format the
    kernels compute on (codes.CODE_TYPES), which come back as runtime layers by module name. The embedding is a
    lookup table and always dequantized; a tied head in such a format comes back as an "lm_head" layer on the
    embedding's codes (the caller unties the config). Routers stay float: they are no linear layer. `keep`: only
    one rank's part (formats/load_slice.py), each tensor cut as it is read."""
    state_dict: dict[str, torch.Tensor] = {}
    coded: dict[str, tuple] = {}  # module name -> runtime_linear's arguments, built once the biases are read
    row_cut: dict[str, Cut] = {}  # coded modules cut along in_features: built whole, then their format's shard()
    skipped = _SKIPPED_TENSORS + config.arch.gguf_skipped
    tensors = [t for t in reader.tensors if not any(t.name.endswith(n) for n in skipped)]
    # a coded layer is built once its bias is read (or at once: it has none), so its codes are not held till the end
    biased = {hf_tensor_name(t.name, config.arch).removesuffix(".bias") for t in tensors if t.name.endswith(".bias")}
    seen: set[str] = set()
    quantized: dict[str, RuntimeLinear] = {}
    for tensor in tqdm(tensors, desc="loading GGUF tensors", unit="tensor", disable=not progress):
        for name, data, expected in _tensor_parts(tensor, config):
            seen.add(name)
            if keep is not None and not keep.holds(name, config.tie_word_embeddings):
                continue  # another rank's layer or expert: never read
            heads = None
            if config.arch.gguf_permutes_qk and (".q_proj." in name or ".k_proj." in name):
                heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            cut = None if keep is None else keep.cut_of(name)
            if cut is not None and cut.axis == COLUMN:  # this rank's rows only: the other rows' pages stay unread
                data, expected, heads = _rows_of(data, expected, heads, cut)
                cut = None
            if not dequantize_gguf and tensor.tensor_type in CODE_TYPES and _is_linear_weight(name):
                if name == "model.embed_tokens.weight":  # a lookup table: dequantized below; as the tied head, codes
                    if config.tie_word_embeddings and (keep is None or keep.has_head):
                        coded["lm_head"] = (tensor.tensor_type, data, expected, None)
                    if keep is not None and not keep.has_embedding:
                        continue  # read for the head alone
                else:
                    row_order = None if heads is None else unpermute_rotary(torch.arange(expected[0]), heads)
                    module = name.removesuffix(".weight")
                    coded[module] = (tensor.tensor_type, data, expected, row_order)
                    if cut is not None:
                        row_cut[module] = cut
                    continue
            weight = _dequantized(tensor, data, expected, heads)
            if config.arch.gguf_norm_offset and name.endswith("norm.weight"):  # llama.cpp folded Gemma's +1 in
                weight = weight - config.arch.gguf_norm_offset
            if cut is not None:
                weight = keep.cut_tensor(name, weight)  # along in_features: cut after dequantizing (blocks)
            if weight is not None:
                state_dict[name] = weight.to(dtype).contiguous()
        for m in [m for m in coded if m not in biased or m + ".bias" in seen]:
            quantized[m] = _runtime_layer(coded.pop(m), state_dict.pop(m + ".bias", None), row_cut.get(m))
        reader.release_pages()  # what was read is copied: this process keeps no page of the file
        return_freed_memory()  # a cut tensor's whole temporaries, freed into the heap: back to the OS, now
    if config.arch.to_model_names is not None:  # Phi-3's fused projections, apart
        fused = set(state_dict)
        state_dict = config.arch.to_model_names(config, state_dict)
        if keep is not None:  # the split parts are the model's linears: cut them now
            parts = {n: keep.cut_tensor(n, t) for n, t in state_dict.items() if n not in fused}
            state_dict = {n: t for n, t in (state_dict | parts).items() if t is not None}
    for m in list(coded):  # a bias (qwen2's q/k/v) stays float, on the runtime layer
        quantized[m] = _runtime_layer(coded.pop(m), state_dict.pop(m + ".bias", None), row_cut.get(m))
    return state_dict, quantized


def _is_linear_weight(name: str) -> bool:
    """A weight that becomes a runtime linear: not a bias, a norm, the router, the shared expert's gate or a fused
    projection (split in floats)."""
    if any(f in name for f in _FUSED):
        return False
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


def _runtime_layer(args: tuple, bias: torch.Tensor | None, cut: Cut | None) -> RuntimeLinear:
    """A coded linear, cut by its format's shard() when this rank holds a slice of its in_features."""
    layer = runtime_linear(*args, bias=bias)
    return layer if cut is None else own(layer.shard(cut.axis, cut.rank, cut.world, cut.sizes))


def _rows_of(
    data: np.ndarray, expected: tuple[int, ...], heads: int | None, cut: Cut
) -> tuple[np.ndarray, tuple[int, ...], int | None]:
    """A column cut's rows of a tensor's data (a copy of those rows' bytes), its shape, and the heads they hold
    (llama.cpp permutes Q/K rows within each head, so whole heads un-permute on their own)."""
    rows = cut.features(expected[0])
    part = np.array(data[rows.start : rows.stop])  # [rows, row bytes or in]
    held = None if heads is None else heads * (rows.stop - rows.start) // expected[0]
    return part, (rows.stop - rows.start, *expected[1:]), held
