"""How one linear layer describes itself to the native decode loop (decode_layers.c): its kernel format
(`KIND_*`), pointers into its own tensors, and the checks that those tensors are what that kernel reads."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from leanlm.kernels import cpu_act_sparse, cpu_bitmask, cpu_gemm, cpu_qgemv, cpu_sparse, cpu_w8a8

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
KIND_BF16, KIND_INT8, KIND_INT4, KIND_W8A8, KIND_SPARSE24, KIND_ACT_SPARSE, KIND_BITMASK = 0, 1, 2, 3, 4, 5, 6
KIND_SPARSE24_INT8, KIND_SPARSE24_INT4 = 7, 8
_SPARSE24_QUANT = (KIND_SPARSE24_INT8, KIND_SPARSE24_INT4)
_BF16, _F32 = torch.bfloat16, torch.float32


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _I64),
        ("weight", _P),
        ("scales", _P),
        ("mins", _P),
        ("bias", _P),
        ("perm", _P),
        ("out_features", _I64),
        ("in_features", _I64),
        ("group_size", _I64),
        ("packed", _P),
        ("packed_scales", _P),
        ("packed_mins", _P),
        ("packed_bias", _P),
        ("packed_bits", _I64),
        ("packed_group", _I64),
        ("mask", _P),
        ("zeros", _P),
        ("row_offsets", _P),
    ]


@dataclass(frozen=True)
class NativeLinear:
    """y = x W^T + b in a kernel format: bf16 weight [N, K]; int8 [N, K] with scales [N] (group_size 0) or
    [N, K / group_size]; 4-bit codes uint8 [N, K / 2] with scales and mins [N, K / group_size] (w = q * scale + min),
    whose columns may be stored in the order perm [K] (int64; the input is gathered as x[:, perm] first, GPTQ
    act-order); W8A8, int8 [N, K] with scales [N] and activations quantized per row, on its cpu_w8a8 packing (always
    set) at every row count; 2:4 values bf16 [N, K / 2] with `mask`; or activation-sparse, the bf16 weight
    transposed [K, N] with its input threshold as `scales` (float32 [1]) and its score scales as `mins` ([K]).
    `packed` is the same weight in cpu_gemm's layout (what the layer's own products use from 9 rows on; 2:4: the
    dense weight's, bitmask too), or None for at most MAX_ROWS. 2:4 with quantized kept weights: int8 codes
    [N, K / 2] or 4-bit codes uint8 [N, K / 4] (cpu_sparse's chunk order) with `mask`, scales [N, K / group_size]
    (group_size K: one per row) and, for 4 bits, `zeros` (uint8 zero codes, of the scales' shape). Unstructured
    sparse (bitmask): the nonzeros bf16 [nnz] row-major with `mask` and `row_offsets`."""

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # bf16 [N]
    group_size: int = 0
    perm: torch.Tensor | None = None
    packed: cpu_gemm.PackedBF16 | cpu_gemm.PackedQuant | cpu_w8a8.PackedW8A8 | None = None
    mask: torch.Tensor | None = None  # KIND_SPARSE24*: uint8 [N, K / 8], 4 bits per group of 4 columns, 2 set;
    # KIND_BITMASK: uint8 [N, K / 8], bit i of byte b set where column 8 b + i holds a value
    zeros: torch.Tensor | None = None  # KIND_SPARSE24_INT4: uint8 [N, K / group_size]
    row_offsets: torch.Tensor | None = None  # KIND_BITMASK: int64 [N], where each row's values start

    @property
    def out_features(self) -> int:
        if self.kind == KIND_BITMASK:  # the weight is 1-D: the mask has the shape
            return self.mask.shape[0]
        return self.weight.shape[1 if self.kind == KIND_ACT_SPARSE else 0]

    @property
    def in_features(self) -> int:
        if self.kind == KIND_BITMASK:
            return 8 * self.mask.shape[1]
        if self.kind == KIND_ACT_SPARSE:
            return self.weight.shape[0]
        if self.kind == KIND_SPARSE24_INT4:
            return self.weight.shape[1] * 4
        return self.weight.shape[1] * (2 if self.kind in (KIND_INT4, KIND_SPARSE24, KIND_SPARSE24_INT8) else 1)

    def is_supported(self) -> bool:
        """Contiguous CPU tensors of the dtypes and shapes the kernel for `kind` reads."""
        if self.kind == KIND_BITMASK and not self._bitmask_shapes_match():  # checked before the shape properties
            return False
        tensors = (self.weight, self.scales, self.mins, self.bias, self.perm, self.mask, self.zeros, self.row_offsets)
        if not all(t.is_cpu and t.is_contiguous() for t in tensors if t is not None):
            return False
        if self.bias is not None and (self.bias.dtype != _BF16 or self.bias.shape != (self.out_features,)):
            return False
        if self.perm is not None and (
            self.kind != KIND_INT4 or self.perm.dtype != torch.int64 or self.perm.shape != (self.in_features,)
        ):
            return False
        if self.packed is not None and not self._packed_matches():
            return False
        if self.kind == KIND_SPARSE24:  # the kernel needs VBMI2 (without it the loop holds a NULL function)
            ok = self.mask is not None and self.mask.dtype == torch.uint8 and self.weight.dtype == _BF16
            return ok and self.mask.shape == (self.out_features, self.in_features // 8) and cpu_sparse.is_available()
        if self.kind in _SPARSE24_QUANT:
            return self._sparse24_quant_ok()
        if self.kind == KIND_BITMASK:  # the kernel needs VBMI2 (without it the loop holds a NULL function)
            return cpu_bitmask.is_available()
        if self.kind == KIND_ACT_SPARSE:  # never packed: a dense GEMM would not sparsify its input
            ok = self.weight.dtype == _BF16 and self.weight.dim() == 2 and self.packed is None
            ok = ok and self.scales is not None and self.scales.dtype == _F32 and self.scales.numel() == 1
            ok = ok and self.mins is not None and self.mins.dtype == _F32 and self.mins.shape == (self.in_features,)
            return ok and cpu_act_sparse.is_available()
        if self.kind == KIND_W8A8:
            return (
                self.weight.dtype == torch.int8
                and isinstance(self.packed, cpu_w8a8.PackedW8A8)
                and self.scales is not None
                and self.scales.dtype == _F32
                and self.scales.shape == (self.out_features,)
                and self.bias is None  # a W8A8 bias lives in the packing (float32)
            )
        if self.kind == KIND_BF16:
            return self.weight.dtype == _BF16
        if self.kind == KIND_INT8:  # group_size 0: scales [N] per channel; else [N, K / group_size]
            gs, K = self.group_size, self.in_features
            shape = (self.out_features,) if gs == 0 else (self.out_features, K // gs)
            return (
                self.weight.dtype == torch.int8
                and (gs == 0 or cpu_qgemv.int8_group_ok(gs, K))
                and self.scales is not None
                and self.scales.dtype == _F32
                and self.scales.shape == shape
            )
        gs = self.group_size
        return (
            self.kind == KIND_INT4
            and self.weight.dtype == torch.uint8
            and gs > 0
            and gs % 32 == 0
            and self.in_features % gs == 0
            and self.scales is not None
            and self.mins is not None
            and self.scales.dtype == _F32
            and self.mins.dtype == _F32
            and self.scales.shape == (self.out_features, self.in_features // gs) == self.mins.shape
        )

    def _sparse24_quant_ok(self) -> bool:
        """Codes, mask, scales (and zeros) of the shapes and dtypes cpu_sparse's quantized kernels read."""
        N, K, gs = self.out_features, self.in_features, self.group_size
        if not (cpu_sparse.quant_group_ok(gs, K) and cpu_sparse.quant_is_available()):
            return False
        int4 = self.kind == KIND_SPARSE24_INT4
        side = [(self.scales, _F32), (self.zeros, torch.uint8)] if int4 else [(self.scales, _F32)]
        return (
            self.weight.dtype == (torch.uint8 if int4 else torch.int8)
            and self.mask is not None
            and self.mask.dtype == torch.uint8
            and self.mask.shape == (N, K // 8)
            and (self.zeros is None) != int4
            and all(t is not None and t.dtype == dtype and t.shape == (N, K // gs) for t, dtype in side)
        )

    def _bitmask_shapes_match(self) -> bool:
        """bf16 values [nnz], mask uint8 [N, K / 8] and row_offsets int64 [N] (the layer checked that they agree)."""
        m, offsets = self.mask, self.row_offsets
        ok = self.weight.dtype == _BF16 and self.weight.dim() == 1 and m is not None and offsets is not None
        ok = ok and m.dtype == torch.uint8 and m.dim() == 2 and offsets.dtype == torch.int64
        return ok and offsets.shape == m.shape[:1]

    def _packed_matches(self) -> bool:
        """The packed weight has this layer's shape, an even K (the loop passes its rows unpadded) and the
        format of `kind` (bf16 panels, 8-bit or 4-bit code panels with this group size)."""
        p = self.packed
        if isinstance(p, cpu_w8a8.PackedW8A8):
            return self.kind == KIND_W8A8 and (p.out_features, p.in_features) == (self.out_features, self.in_features)
        if (p.out_features, p.in_features, p.padded_in_features) != (self.out_features,) + (self.in_features,) * 2:
            return False
        if self.kind in (KIND_BF16, KIND_SPARSE24, KIND_BITMASK):  # 2:4 and bitmask: the dense weight's panels
            return isinstance(p, cpu_gemm.PackedBF16)
        if not isinstance(p, cpu_gemm.PackedQuant):
            return False
        if self.kind in (KIND_INT8, KIND_SPARSE24_INT8):  # per channel packs as one group of K
            return (p.bits, p.group_size) == (8, self.group_size or self.in_features)
        return (p.bits, p.group_size) == (4, self.group_size)

    def to_struct(self) -> _Linear:
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        p = self.packed
        quant = isinstance(p, cpu_gemm.PackedQuant)
        if isinstance(p, cpu_w8a8.PackedW8A8):
            return _Linear(
                self.kind, ptr(self.weight), ptr(self.scales), None, None, None, self.out_features,
                self.in_features, 0, ptr(p.data), ptr(p.scales), None, ptr(p.bias), 8, 0, None, None,
            )  # fmt: skip
        return _Linear(
            self.kind,
            ptr(self.weight),
            ptr(self.scales),
            ptr(self.mins),
            ptr(self.bias),
            ptr(self.perm),
            self.out_features,
            self.in_features,
            self.group_size,
            None if p is None else ptr(p.codes if quant else p.data),
            ptr(p.scales) if quant else None,
            ptr(p.mins) if quant else None,
            None if p is None else ptr(p.bias),
            p.bits if quant else 0,
            p.group_size if quant else 0,
            ptr(self.mask),
            ptr(self.zeros),
            ptr(self.row_offsets),
        )
