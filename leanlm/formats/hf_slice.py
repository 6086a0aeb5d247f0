"""One rank's part of an HF directory (a LoadSlice): the safetensors headers first (the config's layer count and
every held float tensor's shape checked against the config before anything is read), then only the held tensors,
each cut as it is read by positioned reads (loading/byte_slice.py), so the rank never copies, nor maps, the rest."""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from leanlm.config import ModelConfig
from leanlm.formats.hf_dir import _LAYER_INDEX, read_hf_config, shard_files
from leanlm.formats.load_slice import LoadSlice
from leanlm.formats.moe_names import to_model_names
from leanlm.loading.byte_slice import read_block
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.safetensors_header import DTYPE_BYTES, check_safetensors_header
from leanlm.model.linear.shard import COLUMN

_TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's place in a safetensors file, from its (checked) header."""

    file: Path
    offset: int  # of its first byte in the file
    dtype: str  # safetensors' name ("BF16", ...)
    shape: tuple[int, ...]

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """The tensor, or rows x cols of a 2-D one (cols: elements), copied out of the file."""
        item = DTYPE_BYTES[self.dtype]
        if len(self.shape) != 2:
            rows_, width = (self.shape[0], int(np.prod(self.shape[1:], dtype=np.int64))) if self.shape else (1, 1)
            data = read_block(self.file, self.offset, width * item, slice(0, rows_))
            return _as_tensor(data, self.dtype).reshape(self.shape)
        n, k = self.shape
        rows = slice(0, n) if rows is None else rows
        byte_cols = None if cols is None else slice(cols.start * item, cols.stop * item)
        data = read_block(self.file, self.offset, k * item, rows, byte_cols)
        return _as_tensor(data, self.dtype).reshape(rows.stop - rows.start, -1)


def _as_tensor(data: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(data.reshape(-1)).view(_TORCH_DTYPES[dtype])


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the directory's safetensors files by its stored name, from the checked headers."""
    found: dict[str, StoredTensor] = {}
    for file in shard_files(path):
        header = check_safetensors_header(file)  # bounded: length, JSON, dtypes, shapes, byte ranges
        with open(file, "rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
        for name, entry in header.items():
            begin = entry["data_offsets"][0]
            found[name] = StoredTensor(file, 8 + header_bytes + begin, entry["dtype"], tuple(entry["shape"]))
    return found


def load_hf_dir_slice(
    path: Path, dtype: torch.dtype | None, keep: LoadSlice, progress: bool = False, layers: Collection[str] = ()
) -> tuple[ModelConfig, dict[str, torch.Tensor], set[str]]:
    """load_hf_dir for one rank: (config, the held tensors in model names, the modules read whole). Every float
    linear is cut as it is read; the tensors of a quantized layer (a module with tensors other than weight and
    bias, or one of `layers`: the native format's list) come whole, for its format's shard() (stored.py). `dtype`:
    floats cast to it (None: kept as stored)."""
    path = Path(path)
    tensors = stored_tensors(path)
    config = read_hf_dir_config(path)
    keep.check(config.num_hidden_layers, path)
    tied = config.tie_word_embeddings
    names = {n: to_model_names(config, {n: torch.empty(t.shape, device="meta")}) for n, t in tensors.items()}
    whole = set(layers) | {
        m.rsplit(".", 1)[0] for renamed in names.values() for m in renamed if not m.endswith((".weight", ".bias"))
    }
    state_dict: dict[str, torch.Tensor] = {}
    for name, stored in tqdm(tensors.items(), desc="loading this rank's slice", disable=not progress):
        if tied and name == "lm_head.weight":
            continue  # the same tensor as the embedding; the model ties it
        renamed = names[name]
        if len(renamed) != 1:  # a fused tensor (Phi-3's qkv, transformers 5's experts): read whole, then split
            if any(keep.holds(n, tied) for n in renamed):
                parts = to_model_names(config, {name: stored.read()})
                state_dict |= {n: _cut(keep, n, t, whole) for n, t in parts.items() if keep.holds(n, tied)}
            continue
        (model_name,) = renamed
        if keep.holds(model_name, tied):
            _check_shape(config, model_name, stored.shape, path)
            is_whole = model_name.rsplit(".", 1)[0] in whole
            state_dict[model_name] = stored.read() if is_whole else _read_cut(keep, model_name, stored)
    state_dict = {n: t for n, t in state_dict.items() if t is not None}
    if dtype is not None:
        state_dict = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state_dict.items()}
    return config, state_dict, whole


def _cut(keep: LoadSlice, name: str, t: torch.Tensor, whole: set[str]) -> torch.Tensor | None:
    return t if name.rsplit(".", 1)[0] in whole else keep.cut_tensor(name, t)


def _read_cut(keep: LoadSlice, name: str, stored: StoredTensor) -> torch.Tensor | None:
    """Tensor `name` read as this rank keeps it: only its slice when the module is cut (and the file holds it as
    the weight [out, in] or bias [out] of a plain linear); a row-parallel bias off the first rank: None."""
    cut = keep.cut_of(name)
    if cut is None or not name.endswith((".weight", ".bias")):
        return stored.read()
    if name.endswith(".bias"):
        return keep.cut_tensor(name, stored.read())
    if len(stored.shape) != 2:
        return keep.cut_tensor(name, stored.read())
    features = cut.features(stored.shape[cut.axis])
    return stored.read(rows=features) if cut.axis == COLUMN else stored.read(cols=features)


def _check_shape(config: ModelConfig, name: str, shape: tuple[int, ...], path: Path) -> None:
    """A held float linear's, norm's or embedding's header shape against the config, before it is read."""
    module, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias") or not (name.startswith("model.") or name.startswith("lm_head.")):
        return
    try:
        expected = config.tensor_shape(name)
    except (KeyError, ValueError):
        return  # a quantized layer's own tensor (qweight, scales, ...): its format checks it against its metadata
    if shape != tuple(expected) and len(shape) == len(expected) and not _squeezed(name, shape, expected):
        raise ModelLoadError(
            f"{path}: {name} has shape {list(shape)} in its safetensors header, but config.json describes "
            f"{list(expected)}; the checkpoint does not match its config: re-export or re-download it"
        )


def _squeezed(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    return name.endswith(".shared_expert_gate.weight") and shape == tuple(expected[1:])


def read_hf_dir_config(path: Path) -> ModelConfig:
    """The config of an HF directory, its layer count bounded by the tensors the headers list (nothing is read)."""
    names = stored_tensors(Path(path))
    num_layers = 1 + max((int(m.group(1)) for n in names if (m := _LAYER_INDEX.match(n))), default=-1)
    return read_hf_config(Path(path), num_layers)
