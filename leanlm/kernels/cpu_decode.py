"""All decoder layers of a decode step in one native call: decode_layers.c (bf16 activations, AVX512-BF16 CPUs) or
decode_layers_f32.c (float32 activations, AVX2 CPUs: dense and MoE layers, a float32 or int8 cache, every key
read).

The model describes itself once (`NativeLayer`s of `NativeLinear`s: pointers into its own tensors, which the
plan keeps alive); each decode step is then a single ctypes call instead of ~40 PyTorch ops per layer. The
linears and attention run on the same kernels as the PyTorch path: each linear brings its own as calls
(`NativeLinear.few_rows` to 8 rows, `many_rows` from 9: native_linear.py), attention is passed as function
pointers. A bf16 loop whose linears all carry a many-row call takes any number of rows, otherwise at most MAX_ROWS;
the float32 loop takes F32_MAX_ROWS, splitting each product into calls of its kernel's rows.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from leanlm.kernels import cpu_gemm, cpu_qgemv_avx2, paged_attention
from leanlm.kernels.build import NativeKernel
from leanlm.kernels.native_linear import NativeLinear, _Linear
from leanlm.kernels.spec import MIN_PARALLEL_BYTES

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P] * 3 + [_I64] + [_P] * 4 + [_I64] * 2 + [_P, _INT, _P, _P]
_KERNEL = NativeKernel(Path(__file__).with_name("decode_layers.c"), "leanlm_decode_layers", _ARGTYPES, _INT)
_KERNEL_F32 = NativeKernel(
    Path(__file__).with_name("decode_layers_f32.c"),
    "leanlm_decode_layers_f32",
    _ARGTYPES,
    _INT,
    cpu_needs=(),
    level="avx2",
)
MAX_ROWS = 8  # decode tokens per call without packed weights: the GEMV kernels' one-pass limit
MAX_EXPERTS = 1024  # experts per MoE layer the loop routes (MOE_MAX_EXPERTS)
F32_MAX_ROWS = 64  # decode tokens per call of the float32 loop (decode_layers_f32.c's MAX_ROWS)
_BF16, _F32 = torch.bfloat16, torch.float32


class _MoE(ctypes.Structure):
    _fields_ = [
        ("router", _P),
        ("num_experts", _I64),
        ("top_k", _I64),
        ("scoring", _I64),
        ("experts", ctypes.POINTER(_Linear)),
        ("shared", ctypes.POINTER(_Linear)),
        ("counts", _P),
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
        ("moe", _MoE),
    ]


SCORINGS = ("softmax", "softmax_renorm", "ones")  # the C loop's scoring codes 0, 1, 2 (MoEConfig.scoring)


@dataclass(frozen=True)
class NativeMoE:
    """A sparse MLP as the loop runs it: the router, each expert's (gate, up, down), an ungated shared expert, and
    the counters the loop adds its routing to ([E + 2] int64: assignments per expert, tokens, experts run)."""

    router: torch.Tensor  # [E, hidden] in the loop's activation dtype (bf16, or float32 for the AVX2 loop)
    top_k: int
    scoring: str
    experts: tuple[tuple[NativeLinear, NativeLinear, NativeLinear], ...]
    shared: tuple[NativeLinear, NativeLinear, NativeLinear] | None
    counts: torch.Tensor

    def linears(self) -> list[NativeLinear]:
        return [lin for mlp in self.experts + ((self.shared,) if self.shared else ()) for lin in mlp]

    def is_supported(self, dtype: torch.dtype = _BF16) -> bool:
        r = self.router
        return (
            r.dtype == dtype and r.is_cpu and r.is_contiguous() and r.shape[0] == len(self.experts)
            and r.shape[0] <= MAX_EXPERTS and self.scoring in SCORINGS
            and self.counts.dtype == torch.int64 and self.counts.shape == (r.shape[0] + 2,)
            and all(lin.is_supported() for lin in self.linears())
        )  # fmt: skip

    def to_struct(self, keep: list) -> _MoE:
        experts = (_Linear * (3 * len(self.experts)))(*[lin.to_struct() for mlp in self.experts for lin in mlp])
        shared = None if self.shared is None else (_Linear * 3)(*[lin.to_struct() for lin in self.shared])
        keep += [experts, shared]  # the struct points into them
        cast = ctypes.POINTER(_Linear)
        return _MoE(self.router.data_ptr(), len(self.experts), self.top_k, SCORINGS.index(self.scoring),
                    ctypes.cast(experts, cast), None if shared is None else ctypes.cast(shared, cast),
                    self.counts.data_ptr())  # fmt: skip


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
        ("attention", _P),
        ("attention_int8", _P),
        ("min_gemm_rows", _I64),
        ("min_parallel_bytes", _I64),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("max_few_rows", _I64),
    ]


@dataclass(frozen=True)
class NativeLayer:
    """One decoder layer's weights as the C loop reads them: norms and linears in LINEAR_ORDER."""

    input_norm: torch.Tensor  # bf16 [hidden]
    post_norm: torch.Tensor
    linears: tuple[NativeLinear, ...]  # q, k, v, o, gate, up, down (a MoE layer: its first expert's)
    moe: NativeMoE | None = None

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(out_features, in_features) of each linear, in LINEAR_ORDER."""
        return tuple((s.out_features, s.in_features) for s in self.linears)

    def is_supported(self, dtype: torch.dtype = _BF16) -> bool:
        """Contiguous CPU norms (and a MoE layer's router) of the loop's activation dtype, and linears the kernels
        take."""
        norms = (self.input_norm, self.post_norm)
        return (
            all(t.is_cpu and t.is_contiguous() and t.dtype == dtype for t in norms)
            and all(s.is_supported() for s in self.linears)
            and (self.moe is None or self.moe.is_supported(dtype))
        )

    def all_linears(self) -> list[NativeLinear]:
        return list(self.linears) + ([] if self.moe is None else self.moe.linears())


def kv_is_supported(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    dtype: torch.dtype = _BF16,
) -> bool:
    """A contiguous CPU cache [N, Hkv, bs, D]: of the loop's activation dtype, or int8 with float32 scales
    [N, Hkv, bs] (fp8 caches stay on PyTorch)."""
    if not all(t.is_cpu and t.is_contiguous() for t in (k_cache, v_cache)):
        return False
    if k_scales is None or v_scales is None:
        return k_scales is v_scales and k_cache.dtype == dtype == v_cache.dtype
    return k_cache.dtype == torch.int8 == v_cache.dtype and all(
        s.dtype == _F32 and s.is_contiguous() and s.shape == k_cache.shape[:-1] for s in (k_scales, v_scales)
    )


LINEAR_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check_shapes(layers: list[NativeLayer], hidden: int, q_rows: int, kv_rows: int) -> int:
    """The intermediate size every layer shares; ValueError when any linear's shape is not what the model's
    dimensions give it (the C loop splits its scratch by these dimensions and would write past a buffer)."""
    if not layers:
        raise ValueError("the native decode loop needs at least one layer")
    intermediate = layers[0].linears[4].out_features
    expected = (
        (q_rows, hidden),
        (kv_rows, hidden),
        (kv_rows, hidden),
        (hidden, q_rows),
        (intermediate, hidden),
        (intermediate, hidden),
        (hidden, intermediate),
    )
    for i, layer in enumerate(layers):
        for name, got, want in zip(LINEAR_ORDER, layer.shapes(), expected):
            if got != want:
                raise ValueError(
                    f"layer {i} {name} is {got[0]} x {got[1]} (out x in), but the model's dimensions give "
                    f"{want[0]} x {want[1]}; the native decode loop cannot run it"
                )
    return intermediate


def is_available(dtype: torch.dtype = _BF16) -> bool:
    """The loop for `dtype` activations (and, for bf16, the attention it calls) is built and loaded (each linear's
    calls say whether theirs are)."""
    if dtype is _F32:
        return _KERNEL_F32.is_available()
    return dtype is _BF16 and _KERNEL.is_available() and paged_attention.is_available()


class DecodeLayers:
    """The native decode loop over one model's weights. `bind_kv` points it at a KV cache; __call__ runs every
    layer and the final norm. It takes up to `max_rows` tokens a call: MAX_ROWS, or any number when every
    linear carries a many-row call."""

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
        dtype: torch.dtype = _BF16,  # the activations': bf16 (decode_layers.c) or float32 (decode_layers_f32.c)
    ) -> None:
        if dtype not in (_BF16, _F32):
            raise ValueError(f"the native decode loop runs bf16 or float32 activations, not {dtype}")
        self.dtype = dtype
        self._fn = (_KERNEL if dtype is _BF16 else _KERNEL_F32).fn
        self._keep = (layers, final_norm, cos, sin)  # the struct holds raw pointers into these
        # Whether bind_kv succeeded. The struct then points into caches this object does not keep alive: the
        # caller (model/native_decode.py) calls the loop only while the bound caches are the forward's own.
        self._has_kv = False
        hidden = final_norm.shape[0]
        _check_shapes(layers, hidden, num_heads * head_dim, num_kv_heads * head_dim)
        # the gate/up scratch holds the widest MLP of any layer: dense, expert or shared
        intermediate = max(
            lin.out_features for layer in layers for lin in layer.all_linears()[4:] if lin.in_features == hidden
        )
        self._layers = (_Layer * len(layers))()
        self._moe_keep: list = []
        for dst, layer in zip(self._layers, layers):
            dst.input_norm, dst.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for i, linear in enumerate(layer.linears):
                dst.linears[i] = linear.to_struct()
            if layer.moe is not None:
                dst.moe = layer.moe.to_struct(self._moe_keep)
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
            *(paged_attention.native_entries() if dtype is _BF16 else (None, None)),  # the f32 loop attends itself
            cpu_gemm.MIN_ROWS,
            MIN_PARALLEL_BYTES,
            eps,
            head_dim**-0.5,
            0,  # set below for the float32 loop
        )
        self.hidden = hidden
        # Sized from the largest linear of any layer (not layer 0's): the C loop writes out_features rows of each.
        every = [lin for layer in layers for lin in layer.all_linears()]
        widest_output = max(lin.out_features for lin in every)
        widest_input = max(lin.in_features for lin in every)  # room for a permuted input
        self._per_row = hidden + 2 * num_heads * head_dim + 2 * num_kv_heads * head_dim + 2 * widest_output
        self._per_row += widest_input
        if any(layer.moe is not None for layer in layers):
            self._per_row += hidden  # a MoE layer's output (its experts' work space is the C loop's)
        self._scratch = torch.empty(MAX_ROWS * self._per_row, dtype=dtype)  # grown for larger batches
        packed = dtype is _BF16 and all(linear.many_rows is not None for linear in every)
        self.max_rows: int | None = None if packed else MAX_ROWS
        if dtype is _F32:  # the AVX2 GEMVs take 16 rows a call, 64 with int8 activations; the dense float32 GEMV
            # is level with sgemm to 64 rows. The loop takes F32_MAX_ROWS, splitting each product into calls of its
            # kernels' rows: a MoE layer's experts (a few rows each) then read their weights once, and the loop saves
            # PyTorch's per-op steps
            wide = all(linear.name.endswith("a8_f32") or linear.name == "f32" for linear in every)
            self._model.max_few_rows = cpu_qgemv_avx2.MAX_ROWS_A8 if wide else cpu_qgemv_avx2.MAX_ROWS
            self.max_rows = F32_MAX_ROWS
        self._kv_heads_dim = (num_kv_heads, head_dim)

    def bind_kv(self, caches: list) -> bool:
        """Point layer i at caches[i] = (k_cache, v_cache, k_scales, v_scales), each cache [N, Hkv, bs, D]. False
        (and nothing bound) when the loop cannot read them. The caches must outlive every call made on them."""
        self._has_kv = False
        if len(caches) != len(self._layers) or not all(kv_is_supported(*c, dtype=self.dtype) for c in caches):
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
        layer_bounds: torch.Tensor | None = None,
        sink_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, hidden] bf16 embeddings of M <= max_rows decode tokens (one per request; overwritten with the
        residual stream) -> final-normed hidden [M, hidden]. positions, slots, seq_lens [M] and block_tables
        [M, max_blocks]: contiguous CPU int64. The caches given to the last successful bind_kv are used.
        layer_bounds [L, M, 3] int64: each layer's (lo, sinks, stride) per row (leanlm.model.attention_pattern);
        sink_positions [M] int64: where the sinks' query is rotated; None: every key, no sink query."""
        if not self._has_kv:
            raise RuntimeError("the native decode loop has no KV cache bound: call bind_kv first")
        M = x.shape[0]
        index = (positions, slots, block_tables, seq_lens)
        if not (
            0 < M <= (self.max_rows or M)
            and x.dtype is self.dtype
            and x.is_cpu
            and x.is_contiguous()
            and x.shape[1] == self.hidden
            and all(t.dtype is torch.int64 and t.is_cpu and t.is_contiguous() and t.shape[0] == M for t in index)
            and (sink_positions is None or (sink_positions.dtype is torch.int64 and sink_positions.shape == (M,)))
            and (
                layer_bounds is None
                or (
                    layer_bounds.dtype is torch.int64
                    and layer_bounds.is_contiguous()
                    and layer_bounds.shape == (len(self._layers), M, 3)
                )
            )
        ):
            raise ValueError(
                f"the native decode loop takes 1-{self.max_rows or 'any number of'} contiguous {self.dtype} rows of "
                f"{self.hidden} and int64 index tensors with one row each; got x {tuple(x.shape)} {x.dtype}"
            )
        if self._scratch.numel() < M * self._per_row:
            self._scratch = torch.empty(M * self._per_row, dtype=self.dtype)
        out = torch.empty_like(x)
        rc = self._fn()(
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
            None if layer_bounds is None else layer_bounds.data_ptr(),
            None if sink_positions is None else sink_positions.contiguous().data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"the native decode loop failed (code {rc}); positions {positions.tolist()}")
        return out
