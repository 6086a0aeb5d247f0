"""Building blocks of the decoder: RMSNorm and rotary position embeddings (RoFormer; Llama 3 scaling)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from leanlm.config import RopeScaling
from leanlm.config.rope import yarn_inv_freq
from leanlm.kernels import cpu_gemm, cpu_gemv, cpu_gemv_avx2, cpu_rows
from leanlm.kernels.native_linear import NativeLinear, describe
from leanlm.model.linear.dispatch import KernelDispatch
from leanlm.model.linear.shard import COLUMN, check_axis, part, row_bias
from leanlm.model.linear.stack import StackedLinear
from leanlm.model.packed_cache import PackedCache


class Linear(KernelDispatch, nn.Linear):
    """nn.Linear (HF weight names) that runs bf16 CPU products on the native kernels.

    Batch-1..8 decode reads every weight once per token; torch's bf16 GEMV leaves half the memory bandwidth
    unused on CPU, the GEMV kernel (cpu_gemv) does not. From 9 rows on (batched decode, mixed and prefill
    steps) the GEMM kernel (cpu_gemm) runs on a packed copy of the weight, made on the first such product
    and remade when the weight or bias changes (a model that only ever decodes one request never pays its
    memory). Everything else, and anything autograd must see, goes to F.linear.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedCache()  # the weight and bias packed for cpu_gemm

    def _kernels_take(self, x: torch.Tensor) -> bool:
        """bf16 CPU weight and contiguous bf16 rows that autograd need not see (the kernels have no backward)."""
        w = self.weight
        return (
            w.dtype is torch.bfloat16
            and x.dtype is torch.bfloat16
            and w.is_cpu
            and x.is_contiguous()
            and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        )

    def many_rows_fit(self, x: torch.Tensor) -> bool:
        return self._kernels_take(x) and cpu_gemm.should_use(x, self.packed_weight())

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.gemm(x, self.packed.value)

    def few_rows_fit(self, x: torch.Tensor) -> bool:
        return self._kernels_take(x) and x.shape[0] <= cpu_gemv.MAX_ROWS and cpu_gemv.is_available()

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemv.linear_bf16(x, self.weight, self.bias)

    def fallback(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def metadata(self) -> dict[str, int]:
        return {"in_features": self.in_features, "out_features": self.out_features}

    @classmethod
    def from_tensors(cls, meta: dict[str, int], tensors: dict[str, torch.Tensor]) -> Linear:
        """The layer holding `weight` [N, K] (and `bias` [N]) as given, as RuntimeLinear.from_tensors does."""
        weight, bias = tensors["weight"], tensors.get("bias")
        if tuple(weight.shape) != (meta["out_features"], meta["in_features"]):
            raise ValueError(f"weight {list(weight.shape)} does not match out/in features of {meta}")
        layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.detach().float()

    def shard(self, axis: int, rank: int, world: int, sizes: tuple[int, ...] | None = None) -> Linear:
        """As RuntimeLinear.shard: rank's slice of the outputs (COLUMN) or of the inputs (ROW; rank 0: the bias)."""
        check_axis(axis)
        cut = part(self.weight.shape[axis], axis, rank, world, 1, "dense linear", sizes)
        weight, bias = self.weight.detach(), None if self.bias is None else self.bias.detach()
        if axis == COLUMN:
            weight, bias = weight[cut], None if bias is None else bias[cut]
        else:
            weight, bias = weight[:, cut], row_bias(bias, rank)
        shape = {"out_features": weight.shape[0], "in_features": weight.shape[1]}
        tensors = {"weight": weight.contiguous()} | ({} if bias is None else {"bias": bias.contiguous()})
        return Linear.from_tensors(shape, tensors)

    def stack_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.detach()} | ({} if self.bias is None else {"bias": self.bias.detach()})

    @classmethod
    def stack(cls, layers: list[Linear]) -> StackedLinear:
        """E experts (one shape) with weight [E, N, K] and bias [E, N] stacked for a grouped GEMM."""
        return StackedLinear.of(list(layers))

    def packed_weight(self) -> cpu_gemm.PackedBF16 | None:
        """The weight (and bias) packed for cpu_gemm, current with the parameters; None off the kernel's path."""
        if self.weight.dtype is not torch.bfloat16 or not self.weight.is_cpu or not cpu_gemm.is_available():
            return None
        return self.packed.get((self.weight, self.bias), cpu_gemm.pack)

    def native_linear(self, packed: bool = False) -> NativeLinear | None:
        """This layer as the native decode loop runs it (None where its kernels cannot); with `packed`, with its
        packed GEMM too, for loops of more than 8 rows."""
        many = cpu_gemm.native_call(self.packed_weight(), self.out_features, self.in_features) if packed else None
        few = cpu_gemv.native_call(self.weight, self.bias)
        return describe(self.out_features, self.in_features, few, many, packed)

    def native_linear_f32(self) -> NativeLinear | None:
        """This layer as the float32 decode loop runs it (a float32 weight on the AVX2 GEMV), else None."""
        few = cpu_gemv_avx2.native_call(self.weight, self.bias)
        return describe(self.out_features, self.in_features, few, None, False)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like the HF reference, cast back after. Gemma's scales
    by (1 + weight): `offset` 1, its stored weight kept as HF writes it."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset  # the gain is offset + weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        dtype = x.dtype
        if self.offset:
            # Gemma's order: normalise and scale in float32, one rounding at the end
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (self.offset + self.weight.float())).to(dtype)
        if cpu_rows.should_use_rows(x) and self.weight.dtype is torch.bfloat16 and self.weight.is_contiguous():
            # few rows: the native loop's arithmetic, so both paths agree bit for bit
            return cpu_rows.rms_norm(x, self.weight, self.eps)
        if dtype in (torch.bfloat16, torch.float16):
            # fused: float32 inside, one rounding at the end (HF rounds twice; this is the closer of the two)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.to(torch.promote_types(dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, long: bool = True) -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama 3's frequency-dependent scaling when configured; longrope's divided by
    its long factors (or, with `long` False, its short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "longrope":
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
        return (inv_freq / factors).float()
    if scaling.rope_type == "yarn":
        return yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_mid, mid, scaled).float()


class Rope(tuple):
    """(cos, sin) [T, 1, D_rot/2] for every layer, and `local`: the pair the sliding-window layers rotate with when
    they have a rope base of their own (Gemma 3), else None. Unpacks as the pair."""

    local: tuple[torch.Tensor, torch.Tensor] | None

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor, local=None) -> Rope:
        rope = super().__new__(cls, (cos, sin))
        rope.local = local
        return rope

    def first(self, num_rows: int) -> Rope:
        """The tables of the first `num_rows` positions (the local pair's too)."""
        local = None if self.local is None else tuple(t[:num_rows] for t in self.local)
        return Rope(self[0][:num_rows], self[1][:num_rows], local)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF layout) over a cos/sin table indexed by absolute positions; `local_theta`: a second
    table for the sliding-window layers (Gemma 3). Longrope's table takes its short factors below the original
    context and its long ones past it, per position (as vLLM; HF switches every position at once by the sequence's
    length, which a cache of rotated keys cannot follow), both scaled by its attention factor."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        local_theta: float | None = None,
    ) -> None:
        super().__init__()
        self.magnitude = 1.0 if scaling is None else scaling.magnitude  # cos and sin are multiplied by it
        inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [D/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        if scaling is not None and scaling.rope_type == "longrope":
            short = min(max_positions, scaling.original_max_position_embeddings)
            freqs[:short] = torch.outer(
                torch.arange(short, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling, False)
            )
        # Buffers stay float32 (not saved): the table is exact and small.
        self.register_buffer("cos", freqs.cos() * self.magnitude, persistent=False)
        self.register_buffer("sin", freqs.sin() * self.magnitude, persistent=False)
        self.local = None if local_theta is None else RotaryEmbedding(head_dim, max_positions, local_theta, None)

    def ensure(self, num_positions: int) -> None:
        """Grow the table to hold positions 0 .. num_positions - 1 (past the model's context: a bounded window
        keeps every query's distance to its keys within what the model was trained on), doubling at least. The
        new rows' angles are taken in float64, so far positions keep their accuracy; the old rows stay as they are."""
        if self.local is not None:
            self.local.ensure(num_positions)
        have = self.cos.shape[0]
        if num_positions <= have:
            return
        size = max(num_positions, 2 * have)
        positions = torch.arange(have, size, dtype=torch.float64, device=self.cos.device)
        freqs = torch.outer(positions, self.inv_freq.double())  # [new, D/2]
        self.cos = torch.cat((self.cos, (freqs.cos() * self.magnitude).float()))
        self.sin = torch.cat((self.sin, (freqs.sin() * self.magnitude).float()))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos, sin for `positions` [T], each [T, 1, D/2] in the compute dtype; looked up once per forward.

        Half-precision models rotate in their own dtype, as the HF reference does; float32 and float64 stay
        exact (the table is float32).
        """
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return Rope(cos, sin, None if self.local is None else tuple(self.local(positions, dtype)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by (cos, sin) [T, 1, D_rot/2]: its first D_rot dimensions (all, but for a partial
    rotary), the rest passed through."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
