"""GGUF's block formats kept as codes, so a llama.cpp file runs at its own bits with no `quantize` step: Q4_0, Q4_1
and Q4_K linears become IntGroupWeightOnlyLinear layers, Q8_0, Q5_0 and Q6_K group-wise Int8WeightOnlyLinear ones,
each dequantizing to `gguf.quants.dequantize`'s weight bit for bit (tests/formats/gguf/test_codes.py). Other types
(Q5_1, Q5_K, Q2_K, Q3_K, floats) are dequantized by tensors.py."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear

# The runtime layers:
#   - 4-bit Q4_0, Q4_1 and Q4_K linears become IntGroupWeightOnlyLinear layers (4-bit codes in groups of 32,
#     w = q * scale + min) that the int4 kernels compute on;
#   - 8-bit Q8_0, 5-bit Q5_0 and 6-bit Q6_K linears become group-wise Int8WeightOnlyLinear layers (signed int8
#     codes in groups of 32, 16 for Q6_K; w = q * scale) that the int8 kernels compute on (Q5_0 and Q6_K then
#     read 8 bits a weight, not 5.5 or 6.6: still half of bf16).
#
# Each group's scale and min are products of an fp16 and a small integer, exact in float32, so the layer's
# dequantized weight equals `gguf.quants.dequantize` bit for bit (tests/formats/gguf/test_codes.py).
# Block layouts (llama.cpp ggml-common.h), per 32 weights unless said:
#   Q4_0: d fp16, 16 bytes of nibbles; w = d * (q - 8).
#   Q4_1: d fp16, m fp16, 16 bytes; w = d * q + m.
#   Q4_K: per 256 weights d fp16, dmin fp16, 12 bytes of 6-bit (scale, min) pairs for 8 groups, 128 bytes;
#         w = d * sc_j * q - dmin * m_j.
#   Q8_0: d fp16, 32 int8; w = d * q.
#   Q5_0: d fp16, 4 bytes qh (bit e: the fifth bit of element e), 16 bytes of nibbles; w = d * (q - 16).
#   Q6_K: per 256 weights 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per 16
#         weights), d fp16; w = d * sc_j * (q - 32). Per half of 128 weights, ql byte l holds elements l and
#         l + 64 (low, high nibble) and byte l + 32 elements l + 32 and l + 96; qh byte l holds the high bits
#         of elements l, l + 32, l + 64, l + 96 at bits 0, 2, 4, 6.
# In the nibble formats a 32-byte (or 16-byte) run holds elements i (low nibble) and i + 32 (or + 16) (high).

GROUP = 32
Q = GGMLQuantizationType
INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
INT8_TYPES = frozenset({Q.Q8_0, Q.Q5_0, Q.Q6_K})
CODE_TYPES = INT4_TYPES | INT8_TYPES
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144, Q.Q8_0: 34, Q.Q5_0: 22, Q.Q6_K: 210}
_BLOCK_WEIGHTS = {Q.Q4_0: 32, Q.Q4_1: 32, Q.Q4_K: 256, Q.Q8_0: 32, Q.Q5_0: 32, Q.Q6_K: 256}
INT8_GROUP = {Q.Q8_0: 32, Q.Q5_0: 32, Q.Q6_K: 16}  # weights per scale


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


def _blocks(tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Raw bytes [rows, row_bytes] -> [rows, blocks per row, block bytes]."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // _BLOCK_WEIGHTS[tensor_type], -1)
    if blocks.shape[-1] != _BLOCK_BYTES[tensor_type]:
        raise ValueError(f"{tensor_type.name} blocks of {blocks.shape[-1]} bytes, expected {_BLOCK_BYTES[tensor_type]}")
    return blocks


def signed_codes(tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int):
    """A Q8_0, Q5_0 or Q6_K tensor's raw blocks -> codes [rows, cols] int8 and scales [rows, cols / group]
    float32 (group: INT8_GROUP), with w = q * scale."""
    blocks = _blocks(tensor_type, data, rows, cols)
    if tensor_type == Q.Q6_K:
        return _q6_k_codes(blocks, rows, cols)
    scales = _fp16(blocks[..., 0:2])  # [R, B]
    if tensor_type == Q.Q8_0:
        codes = blocks[..., 2:].view(np.int8)  # [R, B, 32]
    else:  # Q5_0: low nibbles from qs, the fifth bit of element e is bit e of the little-endian qh
        qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [R, B, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [R, B, 32]
        codes = ((_nibbles(blocks[..., 6:]) | high).astype(np.int16) - 16).astype(np.int8)
    codes = codes.reshape(rows, cols)
    # one block per row (an expert 32 wide) reshapes as a view of the read-only file map: the layer gets its own copy
    return (codes if codes.flags.writeable else codes.copy()), scales


def _q6_k_codes(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks [R, B, 210] -> codes q - 32 [R, cols] int8, scales d * sc [R, cols / 16] (exact: fp16 x int8)."""
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 64)  # [R, B, half, 64]
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 32)  # [R, B, half, 32]
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1)  # [R, B, half, 128]
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [R, B, 16]
    scales = _fp16(blocks[..., 208:210])[..., None] * sc
    return codes.reshape(rows, cols), scales.reshape(rows, -1)


def group_codes(tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int):
    """A 4-bit tensor's raw blocks [rows, row_bytes] -> codes [rows, cols] uint8 (0..15), scales and mins
    [rows, cols / 32] float32, with w = q * scale + min."""
    blocks = _blocks(tensor_type, data, rows, cols)
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
) -> IntGroupWeightOnlyLinear | Int8WeightOnlyLinear:
    """The linear layer [out, in] = `shape` that computes on the tensor's codes. `row_order`, when given,
    reorders output rows (llama.cpp's Q/K rotary permutation undone: a row permutation leaves groups whole);
    `bias` [out] is already in that order."""
    rows, cols = shape
    if tensor_type in INT8_TYPES:
        codes, scales = (torch.from_numpy(a) for a in by_rows(signed_codes, tensor_type, data, rows, cols))
        if row_order is not None:
            codes, scales = codes[row_order], scales[row_order]
        return Int8WeightOnlyLinear(codes, scales, bias, group_size=INT8_GROUP[tensor_type])
    packed, scales, mins = (torch.from_numpy(a) for a in by_rows(_packed_codes, tensor_type, data, rows, cols))
    if row_order is not None:
        packed, scales, mins = packed[row_order], scales[row_order], mins[row_order]
    return IntGroupWeightOnlyLinear(packed, scales, mins, bias, bits=4, group_size=GROUP)


def _packed_codes(tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int):
    codes, scales, mins = group_codes(tensor_type, data, rows, cols)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales, mins  # pack_int4's layout; codes are 0..15


ROWS_PER_CALL = 4096  # bounds a conversion's temporaries (int16 / uint8 intermediates) to this many rows


def by_rows(convert, tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int) -> tuple:
    """convert(tensor_type, data, rows, cols) -> arrays [rows, ...], run on ROWS_PER_CALL rows at a time into
    arrays allocated once: a 151k-row tied head no longer needs its whole intermediates at once."""
    if rows <= ROWS_PER_CALL:
        return convert(tensor_type, data, rows, cols)
    first = convert(tensor_type, data[:ROWS_PER_CALL], ROWS_PER_CALL, cols)
    out = tuple(np.empty((rows, *a.shape[1:]), dtype=a.dtype) for a in first)
    for start in range(0, rows, ROWS_PER_CALL):
        n = min(ROWS_PER_CALL, rows - start)
        part = first if start == 0 else convert(tensor_type, data[start : start + n], n, cols)
        for o, a in zip(out, part, strict=True):
            o[start : start + n] = a
    return out
