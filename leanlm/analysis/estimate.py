"""What a model costs: parameters by part, weight and KV-cache bytes, peak activations, FLOPs per token, and
the roofline time of prefill and decode steps on a hardware profile. Pure functions over a ModelShape.

The accounting follows the usual inference arithmetic (Kaplan et al. 2020 for 2N FLOPs per token, Pope et al.
2022 "Efficiently Scaling Transformer Inference" for KV memory and the memory/compute bound of each phase).
"""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.analysis.hardware_profiles import Hardware
from leanlm.analysis.model_shape import ModelShape

# ---------------------------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class NumberFormat:
    """How one stored value is encoded: `bits` each, plus a scale (and zero point) shared by `group_size` values."""

    name: str
    bits: int  # bits of one stored value
    group_size: int | None = None  # values sharing one scale; None = per-tensor/per-channel scale (negligible)
    scale_bits: int = 16  # one fp16 scale per group
    zero_bits: int = 0  # asymmetric quantization stores a zero point per group too

    def __post_init__(self) -> None:
        if self.bits < 1:
            raise ValueError(f"format {self.name!r}: bits must be >= 1, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"format {self.name!r}: group_size must be >= 1 (or None for no group scales)")
        if self.scale_bits < 0 or self.zero_bits < 0:
            raise ValueError(f"format {self.name!r}: scale_bits and zero_bits must be >= 0")

    @property
    def bits_per_value(self) -> float:
        """bits + (scale + zero bits) / group size: int4 with g=128 and an fp16 scale is 4.125."""
        if self.group_size is None:
            return float(self.bits)
        return self.bits + (self.scale_bits + self.zero_bits) / self.group_size

    @property
    def is_float(self) -> bool:
        return self.name in ("fp32", "bf16", "fp16")


FORMAT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_KV_ALIASES = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}  # EngineConfig.kv_cache_dtype names


def weight_format(name: str, group_size: int | None = 128, zero_bits: int = 0) -> NumberFormat:
    """fp32 | bf16 | fp16 | fp8 | int8 | int4. int4 has a group scale (GPTQ/AWQ: g=128, fp16 scale, +zero when
    asymmetric); fp8 and int8 use per-tensor or per-output-channel scales, which cost nothing measurable."""
    name = _ALIASES.get(name, name)
    if name not in FORMAT_BITS:
        raise ValueError(f"unknown weight format {name!r}; use one of {', '.join(FORMAT_BITS)}")
    grouped = name == "int4"
    return NumberFormat(name, FORMAT_BITS[name], group_size if grouped else None, zero_bits=zero_bits if grouped else 0)


def kv_format(name: str, head_dim: int, scale_bits: int = 16) -> NumberFormat:
    """KV-cache format. int8/int4 KV keep one scale per token per head (group = head_dim; fp16 by default,
    leanlm's own int8 cache stores float32: scale_bits=32); fp8 KV a per-tensor scale (vLLM's fp8 KV cache).
    leanlm's --kv-cache-dtype names are accepted: fp8_e4m3 and fp8_e5m2 are fp8."""
    name = _KV_ALIASES.get(name, _ALIASES.get(name, name))
    if name not in FORMAT_BITS:
        raise ValueError(f"unknown KV format {name!r}; use one of {', '.join(FORMAT_BITS)}, fp8_e4m3, fp8_e5m2")
    return NumberFormat(name, FORMAT_BITS[name], head_dim if name.startswith("int") else None, scale_bits=scale_bits)


# ---------------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part. Matrices of attention and MLP are what quantization compresses; the rest stays float."""

    embed_tokens: int  # V * d
    position_embeddings: int  # learned absolute positions (GPT), else 0
    lm_head: int  # V * d when untied, 0 when tied (it reuses embed_tokens)
    attention: int  # q/k/v/o matrices of all layers: L * d * (H + 2 Hkv) * D + L * H * D * d
    mlp: int  # MLP matrices of all layers, all experts and the shared ones: L * E * (3 or 2) * d * F for Mixtral
    mlp_active: int  # the MLP matrices one token runs through: L * k * (3 or 2) * d * F for Mixtral
    mlp_shared: int  # of `mlp` (and `mlp_active`): the shared experts and the dense MLPs of layers without experts
    biases: int  # attention and dense biases
    router: int  # Lm * d * E for Lm MoE layers (+ Lm * d for shared-expert gates), else 0
    norms: int  # two per layer and a final one; LayerNorm doubles them (weight + bias)

    @property
    def total(self) -> int:
        return (
            self.embed_tokens
            + self.position_embeddings
            + self.lm_head
            + self.attention
            + self.mlp
            + self.biases
            + self.router
            + self.norms
        )

    @property
    def active(self) -> int:
        """Parameters one token uses (MoE: only its k experts); equals total for a dense model."""
        return self.total - self.mlp + self.mlp_active


def expert_params(s: ModelShape) -> int:
    """One routed expert's matrices in one layer: (3 or 2) * d * F (the whole MLP of a layer for a dense model)."""
    return (3 if s.mlp_gated else 2) * s.hidden_size * s.intermediate_size


def qk_norm_params(s: ModelShape) -> int:
    """One layer's q/k norm weights: over all of q and k (OLMoE), one D-wide norm each (Qwen3, Gemma 3), or none."""
    return {"whole": s.attention_width + s.kv_width, "head": 2 * s.head_dim}.get(s.qk_norm, 0)


def attention_params(s: ModelShape) -> int:
    """One layer's attention matrices: q, k, v, o; under MLA the query (or its bottleneck), the latent projection,
    its per-head expansion and o."""
    d = s.hidden_size
    if not s.kv_lora_rank:
        return d * (s.attention_width + 2 * s.kv_width) + s.attention_width * d
    heads, rank = s.num_attention_heads, s.kv_lora_rank
    query = d * s.q_lora_rank + s.q_lora_rank * s.attention_width if s.q_lora_rank else d * s.attention_width
    nope = s.head_dim - s.qk_rope_head_dim
    latent = d * (rank + s.qk_rope_head_dim) + rank * heads * (nope + s.v_head_dim)
    return query + latent + heads * s.v_head_dim * d


def param_counts(s: ModelShape) -> ParamCounts:
    d, L = s.hidden_size, s.num_hidden_layers
    per_width = (3 if s.mlp_gated else 2) * d  # an MLP's matrices per unit of its width
    attention_bias = (s.attention_width + 2 * s.kv_width) if s.attention_bias else 0  # q, k, v
    dense_bias = (
        (d + (2 if s.mlp_gated else 1) * s.intermediate_size * s.num_experts + d * s.num_experts) if s.dense_bias else 0
    )
    norm_params = d * (2 if s.norm_bias else 1)
    lm = s.moe_layers  # 0 for a dense model: every layer's MLP is one "expert" below
    shared = lm * per_width * s.shared_expert_intermediate_size + (L - lm) * per_width * s.dense_intermediate_size
    if not s.is_moe:
        shared = 0
    routed = (lm if s.is_moe else L) * expert_params(s)  # one expert in every layer that has experts
    return ParamCounts(
        embed_tokens=s.vocab_size * d,
        position_embeddings=s.num_position_embeddings * d,
        lm_head=0 if s.tie_word_embeddings else s.vocab_size * d,
        attention=L * attention_params(s),
        mlp=routed * s.num_experts + shared,
        mlp_active=routed * s.experts_per_token + shared,
        mlp_shared=shared,
        biases=L * (attention_bias + dense_bias),
        router=lm * d * (s.num_experts + (1 if s.shared_expert_gate else 0)),
        norms=(s.norms_per_layer * L + 1) * norm_params + L * (qk_norm_params(s) + s.kv_lora_rank + s.q_lora_rank),
    )


def expected_experts_touched(s: ModelShape, num_tokens: int) -> float:
    """Distinct experts per layer that `num_tokens` tokens route to, in expectation under uniform independent
    top-k routing: E * (1 - (1 - k/E)^T). 1 for a dense model."""
    if not s.is_moe:
        return 1.0
    return s.num_experts * (1 - (1 - s.experts_per_token / s.num_experts) ** num_tokens)


# ---------------------------------------------------------------------------------------------- bytes


def other_format(weights: NumberFormat) -> NumberFormat:
    """Embeddings, lm_head, norms, biases and routers stay in float: fp32 next to fp32 weights, else bf16."""
    return weight_format("fp32") if weights.name == "fp32" else weight_format("bf16")


def weight_bytes(s: ModelShape, fmt: NumberFormat) -> float:
    """All weights at rest: attention and MLP matrices in `fmt`, the rest in `other_format(fmt)`."""
    p = param_counts(s)
    matrices = p.attention + p.mlp
    return (matrices * fmt.bits_per_value + (p.total - matrices) * other_format(fmt).bits_per_value) / 8


def streamed_weight_bytes(s: ModelShape, fmt: NumberFormat, num_tokens: int) -> float:
    """Weight bytes one forward over `num_tokens` tokens reads from memory: every matrix it multiplies by (of the
    routed experts only those its tokens touch, in expectation), the norms, biases and routers, the lm_head (the
    embedding matrix when tied) and, untied, the T embedding rows it looks up."""
    p = param_counts(s)
    mlp = p.mlp
    if s.is_moe:  # the routed experts' share, E per layer, becomes the expected distinct experts touched
        mlp = p.mlp_shared + s.moe_layers * expert_params(s) * expected_experts_touched(s, num_tokens)
    rows = 0 if s.tie_word_embeddings else min(num_tokens, s.vocab_size) * s.hidden_size
    small = p.biases + p.router + p.norms + s.vocab_size * s.hidden_size + rows
    return ((p.attention + mlp) * fmt.bits_per_value + small * other_format(fmt).bits_per_value) / 8


def kv_bytes_per_token(s: ModelShape, fmt: NumberFormat) -> float:
    """K and V rows of every layer: 2 * L * Hkv * D values (MQA/GQA shrink Hkv); under MLA one latent row per layer,
    L * (kv_lora_rank + qk_rope_head_dim) values."""
    if s.kv_lora_rank:
        return s.num_hidden_layers * (s.kv_lora_rank + s.qk_rope_head_dim) * fmt.bits_per_value / 8
    return 2 * s.num_hidden_layers * s.kv_width * fmt.bits_per_value / 8


def kv_cache_bytes(s: ModelShape, fmt: NumberFormat, batch: int, context: int) -> float:
    return kv_bytes_per_token(s, fmt) * batch * context


def peak_activation_bytes(
    s: ModelShape,
    num_tokens: int,
    context: int,
    logits_rows: int,
    activation_bytes: int = 2,
    materialize_scores: bool = False,
) -> float:
    """Largest transient memory of one inference forward over `num_tokens` tokens attending to `context` tokens.

    Assumes no autograd (a layer's tensors die before the next layer) and counts, besides the residual stream
    and its normed copy [T, d], the larger of:
      attention: q, k, v [T, (H + 2 Hkv) D] and the attention output [T, H D]; with `materialize_scores`
        (eager attention) also scores and probabilities [H, T, context] in fp32 (flash/paged kernels keep none);
      MLP: gate, up and act(gate)*up [T, F] (2 for a plain MLP), plus fp32 routing logits [T, E] for MoE;
      logits: [logits_rows, V] in fp32 (our engine computes them only for rows that sample, HF for all T).
    """
    T, d = num_tokens, s.hidden_size
    residual = 2 * T * d * activation_bytes
    attention = (T * (2 * s.attention_width + 2 * s.kv_width)) * activation_bytes
    if materialize_scores:
        attention += 2 * s.num_attention_heads * T * context * 4
    width = max(s.intermediate_size, s.shared_expert_intermediate_size, s.dense_intermediate_size)
    mlp = (3 if s.mlp_gated else 2) * T * width * activation_bytes
    if s.is_moe:
        mlp += T * s.num_experts * 4 + T * d * 4  # router logits, fp32 accumulation of the expert outputs
    logits = logits_rows * s.vocab_size * 4
    return residual + max(attention, mlp, logits)


# ---------------------------------------------------------------------------------------------- FLOPs


def matmul_flops_per_token(s: ModelShape, with_logits: bool = True) -> float:
    """2 FLOPs (multiply + add) per weight a token multiplies by: attention, its k experts, the router, and
    the lm_head (V * d, tied or not). Embedding lookups, norms, biases and activations are not matmuls."""
    p = param_counts(s)
    lm_head = s.vocab_size * s.hidden_size if with_logits else 0
    return 2 * (p.attention + p.mlp_active + p.router + lm_head)


def attention_flops_per_token(s: ModelShape, context: int) -> float:
    """QK^T and AV for one query over `context` keys: 2 * 2 * L * context * H * D."""
    return 4 * s.num_hidden_layers * context * s.attention_width


def decode_flops_per_token(s: ModelShape, context: int) -> float:
    """One new token that attends to `context` tokens (itself included)."""
    return matmul_flops_per_token(s) + attention_flops_per_token(s, context)


def prefill_flops(s: ModelShape, prompt_len: int) -> float:
    """A causal prefill of `prompt_len` tokens: position i attends to i tokens, so the attention term sums to
    4 L H D * n(n+1)/2; logits only for the last position (the one that samples)."""
    n = prompt_len
    return (
        n * matmul_flops_per_token(s, with_logits=False)
        + 2 * s.vocab_size * s.hidden_size
        + 4 * s.num_hidden_layers * s.attention_width * n * (n + 1) / 2
    )


# ---------------------------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class StepCost:
    """Work and memory traffic of one forward step of a batch."""

    phase: str  # "prefill" | "decode"
    batch: int  # sequences in the step
    num_tokens: int  # tokens computed in the step (batch * prompt_len for prefill, batch for decode)
    context: int  # tokens each sequence attends to at the end of the step
    flops: float
    bytes: float  # weights streamed + KV read and written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP/byte."""
        return self.flops / self.bytes


def decode_step(s: ModelShape, weights: NumberFormat, kv: NumberFormat, batch: int, context: int) -> StepCost:
    """`batch` sequences each make one token at `context` (reading context - 1 cached K/V rows, writing one)."""
    kv_row = kv_bytes_per_token(s, kv)
    return StepCost(
        phase="decode",
        batch=batch,
        num_tokens=batch,
        context=context,
        flops=batch * decode_flops_per_token(s, context),
        bytes=streamed_weight_bytes(s, weights, batch) + batch * context * kv_row,
    )


def prefill_step(s: ModelShape, weights: NumberFormat, kv: NumberFormat, batch: int, prompt_len: int) -> StepCost:
    """`batch` prompts of `prompt_len` in one step: K/V written once and read once (a flash kernel's best case)."""
    return StepCost(
        phase="prefill",
        batch=batch,
        num_tokens=batch * prompt_len,
        context=prompt_len,
        flops=batch * prefill_flops(s, prompt_len),
        bytes=(
            streamed_weight_bytes(s, weights, batch * prompt_len) + 2 * batch * prompt_len * kv_bytes_per_token(s, kv)
        ),
    )


def roofline_time(cost: StepCost, hw: Hardware, dtype: str) -> float:
    """Seconds at the roofline: max(FLOPs / peak FLOP/s, bytes / bandwidth); real kernels are slower."""
    return max(cost.flops / hw.flops_for(dtype), cost.bytes / hw.memory_bandwidth)


def is_memory_bound(cost: StepCost, hw: Hardware, dtype: str) -> bool:
    return cost.bytes / hw.memory_bandwidth >= cost.flops / hw.flops_for(dtype)


def serving_memory_bytes(
    s: ModelShape, weights: NumberFormat, kv: NumberFormat, batch: int, context: int, prompt_len: int
) -> float:
    """Weights + KV for `batch` sequences of `context` + the activations of the larger step: a decode of the
    batch, or one prompt's prefill (flash attention, logits for the sampled rows only)."""
    tokens = max(batch, prompt_len)
    return (
        weight_bytes(s, weights)
        + kv_cache_bytes(s, kv, batch, context)
        + peak_activation_bytes(s, tokens, context, logits_rows=batch)
    )


def max_batch(
    s: ModelShape, weights: NumberFormat, kv: NumberFormat, context: int, prompt_len: int, budget_bytes: float
) -> int:
    """Largest batch whose serving memory fits `budget_bytes`; 0 when not even one sequence fits."""
    if serving_memory_bytes(s, weights, kv, 1, context, prompt_len) > budget_bytes:
        return 0
    lo, hi = 1, 2
    while serving_memory_bytes(s, weights, kv, hi, context, prompt_len) <= budget_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: lo fits, hi does not (memory grows with the batch)
        mid = (lo + hi) // 2
        fits = serving_memory_bytes(s, weights, kv, mid, context, prompt_len) <= budget_bytes
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


@dataclass(frozen=True)
class Utilization:
    """How much of the hardware a measured decode throughput uses."""

    mbu: float  # achieved bytes/s over peak bandwidth (model bandwidth utilization)
    mfu: float  # achieved FLOP/s over peak FLOP/s (model FLOPs utilization)


def decode_utilization(
    s: ModelShape, weights: NumberFormat, kv: NumberFormat, hw: Hardware, batch: int, context: int, tokens_per_s: float
) -> Utilization:
    """From a measured decode throughput (tokens/s summed over the batch): steps/s = tokens_per_s / batch."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
    step = decode_step(s, weights, kv, batch, context)
    steps_per_s = tokens_per_s / batch
    return Utilization(
        mbu=step.bytes * steps_per_s / hw.memory_bandwidth, mfu=step.flops * steps_per_s / hw.flops_for(weights.name)
    )
