"""How one linear layer describes itself to the native decode loop (decode_layers.c): for few and for many rows,
a call (linear_call.h) of one kernel's uniform entry with pointers into the layer's own tensors. Each kernel
module builds its calls (`native_call`), checking that the tensors are what its entry reads; the loop knows no
weight format."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from leanlm.kernels.build import NativeKernel

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
MAX_TENSORS, MAX_INTS = 6, 2  # linear_call.h's LEANLM_CALL_TENSORS, LEANLM_CALL_INTS
# leanlm_linear_fn: (call, x, y, M, N, K, threads, min_parallel_bytes)
CALL_ARGTYPES = [_P] * 3 + [_I64] * 3 + [_INT, _I64]


def call_entry(
    source: Path, symbol: str, cpu_needs: tuple[str, ...] = ("avx512_bf16",), level: str = "avx512"
) -> NativeKernel:
    """A kernel library's uniform entry for the decode loop (built and loaded with the library)."""
    return NativeKernel(source, symbol, CALL_ARGTYPES, _INT, cpu_needs=cpu_needs, level=level)


class _Call(ctypes.Structure):
    _fields_ = [("fn", _P), ("tensors", _P * MAX_TENSORS), ("ints", _I64 * MAX_INTS)]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("out_features", _I64),
        ("in_features", _I64),
        ("perm", _P),
        ("few_rows", _Call),
        ("many_rows", _Call),
    ]


@dataclass(frozen=True)
class NativeCall:
    """One kernel of one linear as the loop calls it: `entry` with `tensors` and `ints` in the order it reads them
    (each kernel module's native_call documents its own), `owner` keeping alive what holds them (a packed weight)."""

    name: str  # the kernel, as logs and tests name it ("int8", "gemm_quant", ...)
    entry: NativeKernel
    tensors: tuple[torch.Tensor | None, ...]
    ints: tuple[int, ...] = ()
    owner: Any = None

    def __post_init__(self) -> None:
        if len(self.tensors) > MAX_TENSORS or len(self.ints) > MAX_INTS:
            raise ValueError(f"a native call holds at most {MAX_TENSORS} tensors and {MAX_INTS} ints")

    def is_supported(self) -> bool:
        """Contiguous CPU tensors and the entry loaded."""
        tensors_ok = all(t.is_cpu and t.is_contiguous() for t in self.tensors if t is not None)
        return tensors_ok and self.entry.is_available()

    def to_struct(self) -> _Call:
        tensors = [None if t is None else t.data_ptr() for t in self.tensors]
        tensors += [None] * (MAX_TENSORS - len(tensors))
        ints = list(self.ints) + [0] * (MAX_INTS - len(self.ints))
        return _Call(self.entry.address(), (_P * MAX_TENSORS)(*tensors), (_I64 * MAX_INTS)(*ints))


@dataclass(frozen=True)
class NativeLinear:
    """y [M, N] = x [M, K] W^T + b as the loop runs it: `few_rows` below cpu_gemm.MIN_ROWS rows, `many_rows` from
    there on (None: this linear takes at most 8 rows; W8A8 gives the same call for both), the input gathered as
    x[:, perm] first where `perm` [K] (int64, GPTQ act-order) is set."""

    out_features: int
    in_features: int
    few_rows: NativeCall
    many_rows: NativeCall | None = None
    perm: torch.Tensor | None = None

    @property
    def name(self) -> str:
        """The few-row kernel's name: which format's kernel the loop runs for this linear."""
        return self.few_rows.name

    def is_supported(self) -> bool:
        calls = (self.few_rows,) if self.many_rows is None else (self.few_rows, self.many_rows)
        perm_ok = self.perm is None or (
            self.perm.dtype == torch.int64
            and tuple(self.perm.shape) == (self.in_features,)
            and self.perm.is_cpu
            and self.perm.is_contiguous()
        )
        return perm_ok and all(call.is_supported() for call in calls)

    def to_struct(self) -> _Linear:
        many = _Call() if self.many_rows is None else self.many_rows.to_struct()  # fn NULL: at most 8 rows
        perm = None if self.perm is None else self.perm.data_ptr()
        return _Linear(self.out_features, self.in_features, perm, self.few_rows.to_struct(), many)


def describe(
    out_features: int,
    in_features: int,
    few_rows: NativeCall | None,
    many_rows: NativeCall | None,
    packed: bool,
    perm: torch.Tensor | None = None,
) -> NativeLinear | None:
    """A layer's NativeLinear from its kernels' calls; None (the loop then stays off) where its few-row call is
    missing, or its many-row one when the loop is to take any number of rows (`packed`)."""
    if few_rows is None or (packed and many_rows is None):
        return None
    return NativeLinear(out_features, in_features, few_rows, many_rows if packed else None, perm)
