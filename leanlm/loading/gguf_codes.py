"""GGUF's 4-bit block formats kept as codes: Q4_0, Q4_1 and Q4_K linears become IntGroupWeightOnlyLinear layers
(4-bit codes in groups of 32, w = q * scale + min) that the int4 kernels compute on, so a llama.cpp file runs
at its own bits with no `quantize` step.

Each group's scale and min are products of an fp16 and a small integer, exact in float32, so the layer's
dequantized weight equals `gguf.quants.dequantize` bit for bit (tests/loading/test_gguf_codes.py).
Block layouts (llama.cpp ggml-common.h), per 32 weights unless said:
  Q4_0: d fp16, 16 bytes of nibbles; w = d * (q - 8).
  Q4_1: d fp16, m fp16, 16 bytes; w = d * q + m.
  Q4_K: per 256 weights d fp16, dmin fp16, 12 bytes of 6-bit (scale, min) pairs for 8 groups, 128 bytes;
        w = d * sc_j * q - dmin * m_j.
In all three a 32-byte (or 16-byte) run of nibbles holds elements i (low nibble) and i + 32 (or + 16) (high).
Other types (Q5_*, Q6_K, Q8_0, floats) are dequantized as before.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from leanlm.model.quantized.linear import IntGroupWeightOnlyLinear

GROUP = 32
Q = GGMLQuantizationType
CODE_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144}
_BLOCK_WEIGHTS = {Q.Q4_0: 32, Q.Q4_1: 32, Q.Q4_K: 256}


def _fp16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16, as GGUF stores it)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: low nibbles are elements 0..n-1, high nibbles n..2n-1."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, 12] -> 6-bit scales and mins [B, 8]: groups 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); groups 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def group_codes(tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int):
    """A tensor's raw blocks [rows, row_bytes] -> codes [rows, cols] uint8 (0..15), scales and mins
    [rows, cols / 32] float32, with w = q * scale + min."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // _BLOCK_WEIGHTS[tensor_type], -1)
    if blocks.shape[-1] != _BLOCK_BYTES[tensor_type]:
        raise ValueError(f"{tensor_type.name} blocks of {blocks.shape[-1]} bytes, expected {_BLOCK_BYTES[tensor_type]}")
    if tensor_type == Q.Q4_K:
        d, dmin = _fp16(blocks[..., 0:2])[..., None], _fp16(blocks[..., 2:4])[..., None]  # [R, B, 1]
        sc, mn = _q4_k_scales(blocks[..., 4:16].reshape(-1, 12))
        scales = d * sc.reshape(rows, -1, 8)  # [R, B, 8]: exact (fp16 x 6-bit integer)
        mins = -(dmin * mn.reshape(rows, -1, 8))
        codes = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32))  # [R, B, 4 chunks, 64]
    else:
        d = _fp16(blocks[..., 0:2])  # [R, B]
        if tensor_type == Q.Q4_1:
            scales, mins, qs = d, _fp16(blocks[..., 2:4]), blocks[..., 4:]
        else:  # Q4_0: d * (q - 8) == d * q + (-8 d), both terms exact
            scales, mins, qs = d, -8.0 * d, blocks[..., 2:]
        codes = _nibbles(qs)  # [R, B, 32]
    return codes.reshape(rows, cols), scales.reshape(rows, -1), mins.reshape(rows, -1)


def runtime_linear(
    tensor_type: GGMLQuantizationType,
    data: np.ndarray,
    shape: tuple[int, int],
    row_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> IntGroupWeightOnlyLinear:
    """The linear layer [out, in] = `shape` that computes on the tensor's codes. `row_order`, when given,
    reorders output rows (llama.cpp's Q/K rotary permutation undone: a row permutation leaves groups whole);
    `bias` [out] is already in that order."""
    rows, cols = shape
    codes, scales, mins = group_codes(tensor_type, data, rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # pack_int4's layout; codes are 0..15 by construction
    packed, scales, mins = torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(mins)
    if row_order is not None:
        packed, scales, mins = packed[row_order], scales[row_order], mins[row_order]
    return IntGroupWeightOnlyLinear(packed, scales, mins, bias, bits=4, group_size=GROUP)
