"""All decoder layers of a decode step in one native call (decode_layers.c), on AVX512-BF16 CPUs.

The model describes itself once (`NativeLayer`s of `NativeLinear`s: pointers into its own tensors, which the
plan keeps alive); each decode step is then a single ctypes call instead of ~40 PyTorch ops per layer. The
linears and attention run on the same kernels as the PyTorch path (cpu_gemv, cpu_qgemv, cpu_sparse to 8 rows,
cpu_gemm from 9, paged_attention), passed to the C loop as function pointers. A loop whose linears carry their
packed weights (`NativeLinear.packed`) takes any number of rows; without them, at most MAX_ROWS.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm.kernels import cpu_gemm, cpu_gemv, cpu_qgemv, cpu_sparse, cpu_w8a8, paged_attention
from leanlm.kernels.build import NativeKernel
from leanlm.kernels.cpu_gemv import MIN_PARALLEL_BYTES

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_KERNEL = NativeKernel(
    source=Path(__file__).with_name("decode_layers.c"),
    symbol="leanlm_decode_layers",
    argtypes=[_P] * 3 + [_I64] + [_P] * 4 + [_I64] * 2 + [_P, _INT],
    restype=_INT,
)
MAX_ROWS = 8  # decode tokens per call without packed weights: the GEMV kernels' one-pass limit
KIND_BF16, KIND_INT8, KIND_INT4, KIND_W8A8, KIND_SPARSE24 = 0, 1, 2, 3, 4
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
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("linears", _Linear * 7),
        ("k_cache", _P),
        ("v_cache", _P),
        ("k_scales", _P),
        ("v_scales", _P),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        (name, _I64)
        for name in (
            "num_layers",
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
            "block_size",
            "rope_positions",
        )
    ] + [
        ("cos", _P),
        ("sin", _P),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("linear_bf16", _P),
        ("linear_int8", _P),
        ("linear_int4", _P),
        ("attention", _P),
        ("attention_int8", _P),
        ("gemm_bf16", _P),
        ("gemm_quant", _P),
        ("gemm_w8a8", _P),
        ("linear_sparse24", _P),
        ("min_gemm_rows", _I64),
        ("min_parallel_bytes", _I64),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
    ]


@dataclass(frozen=True)
class NativeLinear:
    """y = x W^T + b in a kernel format: bf16 weight [N, K]; int8 [N, K] with scales [N] (group_size 0) or
    [N, K / group_size]; 4-bit codes uint8 [N, K / 2] with scales and mins [N, K / group_size] (w = q * scale + min),
    whose columns may be stored in the order perm [K] (int64; the input is gathered as x[:, perm] first, GPTQ
    act-order); W8A8, int8 [N, K] with scales [N] and activations quantized per row, on its cpu_w8a8 packing (always
    set) at every row count; or 2:4 values bf16 [N, K / 2] with `mask`. `packed` is the same weight in cpu_gemm's
    layout (what the layer's own products use from 9 rows on; 2:4: the dense weight's), or None for at most MAX_ROWS."""

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # bf16 [N]
    group_size: int = 0
    perm: torch.Tensor | None = None
    packed: cpu_gemm.PackedBF16 | cpu_gemm.PackedQuant | cpu_w8a8.PackedW8A8 | None = None
    mask: torch.Tensor | None = None  # KIND_SPARSE24: uint8 [N, K / 8], 4 bits per group of 4 columns, 2 set

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * (2 if self.kind in (KIND_INT4, KIND_SPARSE24) else 1)

    def is_supported(self) -> bool:
        """Contiguous CPU tensors of the dtypes and shapes the kernel for `kind` reads."""
        tensors = [t for t in (self.weight, self.scales, self.mins, self.bias, self.perm, self.mask) if t is not None]
        if not all(t.is_cpu and t.is_contiguous() for t in tensors):
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

    def _packed_matches(self) -> bool:
        """The packed weight has this layer's shape, an even K (the loop passes its rows unpadded) and the
        format of `kind` (bf16 panels, 8-bit or 4-bit code panels with this group size)."""
        p = self.packed
        if isinstance(p, cpu_w8a8.PackedW8A8):
            return self.kind == KIND_W8A8 and (p.out_features, p.in_features) == (self.out_features, self.in_features)
        if (p.out_features, p.in_features, p.padded_in_features) != (self.out_features,) + (self.in_features,) * 2:
            return False
        if self.kind in (KIND_BF16, KIND_SPARSE24):  # 2:4: the dense weight's panels
            return isinstance(p, cpu_gemm.PackedBF16)
        if not isinstance(p, cpu_gemm.PackedQuant):
            return False
        if self.kind == KIND_INT8:  # per channel packs as one group of K
            return (p.bits, p.group_size) == (8, self.group_size or self.in_features)
        return (p.bits, p.group_size) == (4, self.group_size)

    def to_struct(self) -> _Linear:
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        p = self.packed
        quant = isinstance(p, cpu_gemm.PackedQuant)
        if isinstance(p, cpu_w8a8.PackedW8A8):
            return _Linear(
                self.kind, ptr(self.weight), ptr(self.scales), None, None, None, self.out_features,
                self.in_features, 0, ptr(p.data), ptr(p.scales), None, ptr(p.bias), 8, 0, None,
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
        )


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer's weights as the C loop reads them: norms and linears in LINEAR_ORDER."""

    input_norm: torch.Tensor  # bf16 [hidden]
    post_norm: torch.Tensor
    linears: tuple[NativeLinear, ...]  # q, k, v, o, gate, up, down

    def is_supported(self) -> bool:
        """bf16 contiguous CPU norms and linears the kernels take."""
        norms = (self.input_norm, self.post_norm)
        return all(t.is_cpu and t.is_contiguous() and t.dtype == _BF16 for t in norms) and all(
            s.is_supported() for s in self.linears
        )


def kv_is_supported(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None
) -> bool:
    """A contiguous CPU cache [N, Hkv, bs, D]: bf16, or int8 with float32 scales [N, Hkv, bs] (fp8 caches stay
    on PyTorch)."""
    if not all(t.is_cpu and t.is_contiguous() for t in (k_cache, v_cache)):
        return False
    if k_scales is None or v_scales is None:
        return k_scales is v_scales and k_cache.dtype == _BF16 == v_cache.dtype
    return k_cache.dtype == torch.int8 == v_cache.dtype and all(
        s.dtype == _F32 and s.is_contiguous() and s.shape == k_cache.shape[:-1] for s in (k_scales, v_scales)
    )


LINEAR_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_available() -> bool:
    """The loop and every kernel it calls are built and loaded."""
    return (
        _KERNEL.is_available()
        and cpu_gemv.is_available()
        and cpu_qgemv.is_available()
        and cpu_gemm.is_available()
        and cpu_gemm.quant_is_available()
        and paged_attention.is_available()
    )


def _fn_address(kernel: NativeKernel) -> int:
    return ctypes.cast(kernel.fn(), ctypes.c_void_p).value


class DecodeLayers:
    """The native decode loop over one model's weights. `bind_kv` points it at a KV cache; __call__ runs every
    layer and the final norm. It takes up to `max_rows` tokens a call: MAX_ROWS, or any number when every
    linear carries its packed weight."""

    def __init__(
        self,
        layers: list[NativeLayer],
        final_norm: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        self._keep = (layers, final_norm, cos, sin)  # the struct holds raw pointers into these
        # Whether bind_kv succeeded. The struct then points into caches this object does not keep alive: the
        # caller (model/native_decode.py) calls the loop only while the bound caches are the forward's own.
        self._has_kv = False
        hidden = final_norm.shape[0]
        intermediate = layers[0].linears[4].out_features
        self._layers = (_Layer * len(layers))()
        for dst, layer in zip(self._layers, layers):
            dst.input_norm, dst.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for i, linear in enumerate(layer.linears):
                dst.linears[i] = linear.to_struct()
        self._model = _Model(
            len(layers),
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate,
            0,
            cos.shape[0],
            cos.data_ptr(),
            sin.data_ptr(),
            self._layers,
            final_norm.data_ptr(),
            _fn_address(cpu_gemv._KERNEL),
            _fn_address(cpu_qgemv._INT8_KERNEL),
            _fn_address(cpu_qgemv._INT4_KERNEL),
            _fn_address(paged_attention._KERNEL),
            _fn_address(paged_attention._KERNEL_INT8),
            _fn_address(cpu_gemm._KERNEL),
            _fn_address(cpu_gemm._QUANT_KERNEL),
            _fn_address(cpu_w8a8._KERNEL) if cpu_w8a8.is_available() else None,
            _fn_address(cpu_sparse._KERNEL) if cpu_sparse.is_available() else None,
            cpu_gemm.MIN_ROWS,
            MIN_PARALLEL_BYTES,
            eps,
            head_dim**-0.5,
        )
        self.hidden = hidden
        widest_input = max(hidden, num_heads * head_dim, intermediate)  # room for a permuted input
        self._per_row = hidden + 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim + 2 * intermediate
        self._per_row += widest_input
        self._scratch = torch.empty(MAX_ROWS * self._per_row, dtype=_BF16)  # grown for larger batches
        packed = all(linear.packed is not None for layer in layers for linear in layer.linears)
        self.max_rows: int | None = None if packed else MAX_ROWS
        self._kv_heads_dim = (num_kv_heads, head_dim)

    def bind_kv(self, caches: list) -> bool:
        """Point layer i at caches[i] = (k_cache, v_cache, k_scales, v_scales), each cache [N, Hkv, bs, D]. False
        (and nothing bound) when the loop cannot read them. The caches must outlive every call made on them."""
        self._has_kv = False
        if len(caches) != len(self._layers) or not all(kv_is_supported(*c) for c in caches):
            return False
        shape = caches[0][0].shape
        if (shape[1], shape[3]) != self._kv_heads_dim or any(c[0].shape != shape for c in caches):
            return False
        for dst, (k_cache, v_cache, k_scales, v_scales) in zip(self._layers, caches):
            dst.k_cache, dst.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            dst.k_scales = None if k_scales is None else k_scales.data_ptr()
            dst.v_scales = None if v_scales is None else v_scales.data_ptr()
        self._model.block_size = shape[2]
        self._has_kv = True
        return True

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """x [M, hidden] bf16 embeddings of M <= max_rows decode tokens (one per request; overwritten with the
        residual stream) -> final-normed hidden [M, hidden]. positions, slots, seq_lens [M] and block_tables
        [M, max_blocks]: contiguous CPU int64. The caches given to the last successful bind_kv are used."""
        if not self._has_kv:
            raise RuntimeError("the native decode loop has no KV cache bound: call bind_kv first")
        M = x.shape[0]
        index = (positions, slots, block_tables, seq_lens)
        if not (
            0 < M <= (self.max_rows or M)
            and x.dtype is _BF16
            and x.is_cpu
            and x.is_contiguous()
            and x.shape[1] == self.hidden
            and all(t.dtype is torch.int64 and t.is_cpu and t.is_contiguous() and t.shape[0] == M for t in index)
        ):
            raise ValueError(
                f"the native decode loop takes 1-{self.max_rows or 'any number of'} contiguous bf16 rows of "
                f"{self.hidden} and int64 index tensors with one row each; got x {tuple(x.shape)} {x.dtype}"
            )
        if self._scratch.numel() < M * self._per_row:
            self._scratch = torch.empty(M * self._per_row, dtype=_BF16)
        out = torch.empty_like(x)
        rc = _KERNEL.fn()(
            ctypes.byref(self._model),
            x.data_ptr(),
            out.data_ptr(),
            M,
            positions.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.shape[1],
            max_seq_len,
            self._scratch.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"leanlm_decode_layers failed (code {rc}); positions {positions.tolist()}")
        return out
