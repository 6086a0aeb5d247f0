"""The GPTQ checkpoint layout the ecosystem reads (AutoGPTQ / GPTQModel "gptq" format, loaded by HF
transformers and vLLM): per layer `qweight` int32 [K / 8, N] (eight 4-bit codes per int32 along K, lowest
bits first), `qzeros` int32 [G, N / 8] (zero point minus one, packed along N), `scales` fp16 [G, N] and
`g_idx` int32 [K] (each input column's group). Conversions between it and our group-wise 4-bit runtime layer;
loading/quantized.py reads such checkpoints, compress/gptq_format.py writes them.
"""

from __future__ import annotations

import torch

from leanlm.model.quantized.linear import IntGroupWeightOnlyLinear
from leanlm.model.quantized.numerics import pack_int4, unpack_int4

BITS = 4  # the layout packs 32 / bits codes per int32; we export and import 4-bit
CODES_PER_INT32 = 32 // BITS


def pack_int32_rows(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [R, C] (R a multiple of 8) -> int32 [R / 8, C]: row r's code in bits 4 (r % 8) of row r / 8."""
    r, c = codes.shape
    if r % CODES_PER_INT32:
        raise ValueError(f"{r} rows are not a multiple of {CODES_PER_INT32}")
    v = codes.to(torch.int64).view(r // CODES_PER_INT32, CODES_PER_INT32, c)
    shifts = (torch.arange(CODES_PER_INT32, dtype=torch.int64) * BITS).view(1, -1, 1)
    packed = (v << shifts).sum(dim=1)  # [R/8, C] in 0 .. 2^32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int32_rows: int32 [R / 8, C] -> int64 codes [R, C]."""
    v = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(CODES_PER_INT32, dtype=torch.int64) * BITS).view(1, -1, 1)
    codes = (v.unsqueeze(1) >> shifts) & (2**BITS - 1)  # [R/8, 8, C]
    return codes.reshape(-1, packed.shape[1])


def to_gptq_tensors(layer: IntGroupWeightOnlyLinear) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales / g_idx (+ bias) of one 4-bit layer, in the original column order."""
    if layer.bits != BITS:
        raise ValueError(f"the GPTQ layout holds {BITS}-bit codes; this layer has {layer.bits}")
    k = layer.in_features
    codes = unpack_int4(layer.qweight).to(torch.int64)  # [N, K] stored order
    zeros = torch.round(-layer.mins / layer.scales)  # [N, G]: w = (q - z) * s
    if (zeros < 1).any() or (zeros > 15).any():
        raise ValueError(
            "a group has zero point 0, which the GPTQ format (zero - 1 stored) cannot hold; "
            "quantize with symmetric=True for GPTQ export"
        )
    group_of_stored = torch.arange(k) // layer.group_size  # [K]
    g_idx = group_of_stored
    if layer.perm is not None:
        orig = torch.empty_like(codes).index_copy_(1, layer.perm.cpu(), codes)
        g_idx = torch.empty_like(group_of_stored).index_copy_(0, layer.perm.cpu(), group_of_stored)
        codes = orig
    tensors = {
        "qweight": pack_int32_rows(codes.t().contiguous()),  # [K/8, N]
        "qzeros": pack_int32_rows(zeros.to(torch.int64) - 1).t().contiguous(),  # [G, N/8], packed along N
        "scales": layer.scales.t().contiguous().to(torch.float16),  # [G, N]
        "g_idx": g_idx.to(torch.int32),
    }
    if layer.bias is not None:
        tensors["bias"] = layer.bias.to(torch.float16)
    return tensors


def from_gptq_tensors(tensors: dict[str, torch.Tensor], group_size: int) -> IntGroupWeightOnlyLinear:
    """Our runtime layer from one GPTQ layer's tensors (any g_idx whose groups each hold group_size columns)."""
    qweight, scales = tensors["qweight"], tensors["scales"].float()
    if (
        qweight.dim() != 2
        or qweight.dtype != torch.int32
        or 0 in qweight.shape
        or isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
    ):
        raise ValueError(
            f"GPTQ qweight must be a non-empty int32 matrix and group_size a positive integer, got "
            f"{qweight.dtype} {list(qweight.shape)} and group_size={group_size!r}"
        )
    codes = unpack_int32_rows(qweight).t()  # [N, K]
    n, k = codes.shape
    if k % group_size:
        raise ValueError(f"GPTQ layer of K={k} input columns is not a multiple of group_size={group_size}")
    num_groups = k // group_size
    if scales.shape != (num_groups, n) or tensors["qzeros"].shape != (num_groups, -(-n // CODES_PER_INT32)):
        raise ValueError(
            f"GPTQ scales {list(scales.shape)} / qzeros {list(tensors['qzeros'].shape)} do not match "
            f"[G, N] = [{num_groups}, {n}] / [G, N / {CODES_PER_INT32}]"
        )
    zeros = (unpack_int32_rows(tensors["qzeros"].t().contiguous())[:n] + 1).float()  # [N, G]
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        if g_idx.dim() != 1 or g_idx.numel() != k or g_idx.dtype.is_floating_point:
            raise ValueError(
                f"GPTQ g_idx must hold one integer group per input column ({k}), got {g_idx.dtype} {list(g_idx.shape)}"
            )
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
            raise ValueError(f"GPTQ g_idx holds groups outside [0, {num_groups})")
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        perm = torch.argsort(g_idx.long(), stable=True)  # stored column j = input column perm[j]
        counts = torch.bincount(g_idx.long(), minlength=k // group_size)
        if (counts != group_size).any():
            raise ValueError("g_idx groups do not each hold group_size columns; this GPTQ layout is not supported")
        codes = codes[:, perm]
    s = scales.t().contiguous()  # [N, G]
    return IntGroupWeightOnlyLinear(
        pack_int4(codes), s, -zeros * s, tensors.get("bias"), bits=BITS, group_size=group_size, perm=perm
    )
