"""What tensor and pipeline parallelism cost and give (pure functions over a ModelShape): bytes per device, the
all-reduce and point-to-point bytes per token, the pipeline bubble, and a decode step's time at the roofline plus
the links' latency and bandwidth. The byte counts follow leanlm.parallel exactly (heads split by KV group, the
all-reduce summed in float32 for half-precision activations), so a run's counters check them."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.analysis import estimate as est
from leanlm.analysis.hardware_profiles import Hardware
from leanlm.analysis.model_shape import ModelShape
from leanlm.parallel.heads import split_heads
from leanlm.parallel.pipeline import stage_bounds

# Per-direction link bandwidth (bytes/s) and one collective's latency (s) between two devices of a node.
# GPUs: NVLink 4 (H100/H200) 450 GB/s, NVLink 3 (A100) 300 GB/s, ~5 us per NCCL all-reduce of a small message.
# This machine: two processes through gloo on loopback TCP; benchmarks/parallel_bench.py measures it.
LINKS: dict[str, tuple[float, float]] = {"h100": (450e9, 5e-6), "h200": (450e9, 5e-6), "a100": (300e9, 5e-6)}
CPU_LINK = (2e9, 60e-6)


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    microbatches: int  # a step's micro-batches in flight through the stages
    link_bandwidth: float  # bytes/s between two devices
    link_latency_s: float  # one collective or send, however small

    def __post_init__(self) -> None:
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.microbatches) < 1:
            raise ValueError(f"parallel sizes and micro-batches must be >= 1, got {self}")
        if self.link_bandwidth <= 0 or self.link_latency_s < 0:
            raise ValueError("link bandwidth must be > 0 and latency >= 0")


def reduce_bytes(act_bytes: int) -> int:
    """Bytes per element an all-reduce moves: leanlm sums half-precision partials in float32."""
    return max(act_bytes, 4)


def all_reduce_bytes_per_token(s: ModelShape, layers: int, first_stage: bool, act_bytes: int) -> float:
    """Payload of a stage's all-reduces for one token: o_proj and down_proj of each layer, and the embedding's."""
    return (2 * layers + (1 if first_stage else 0)) * s.hidden_size * reduce_bytes(act_bytes)


def device_weight_bytes(s: ModelShape, fmt: est.NumberFormat, tp: int, layers: int, first: bool, last: bool) -> float:
    """Weights on the largest tensor rank of a stage of `layers` layers: its heads (by KV group) and FFN columns, its
    vocabulary slice of the embedding (first stage) and head (last stage; a tied head is its own copy off stage 0),
    norms whole."""
    heads = split_heads(s.num_attention_heads, s.num_key_value_heads, tp)
    q = max(h.num_heads for h in heads) * s.head_dim
    kv = max(h.num_kv_heads for h in heads) * s.head_dim
    d, per_layer_matrices = s.hidden_size, 0
    per_layer_matrices += d * (q + 2 * kv) + q * d  # q, k, v, o
    per_layer_matrices += est.param_counts(s).mlp / s.num_hidden_layers / tp  # every expert; MoE: a layer's average
    other = est.other_format(fmt).bits_per_value / 8
    vocab = s.vocab_size * d / tp
    small = layers * 2 * d + (d if last else 0)  # norms
    small += layers * (q + 2 * kv) if s.attention_bias else 0
    small += vocab if first else 0
    small += vocab if last and (not s.tie_word_embeddings or not first) else 0
    return layers * per_layer_matrices * fmt.bits_per_value / 8 + small * other


@dataclass(frozen=True)
class ParallelCost:
    weight_bytes_per_device: float  # the largest device's
    kv_bytes_per_token_per_device: float
    all_reduce_bytes_per_token: float  # payload summed over one stage's all-reduces (the first, largest, stage)
    all_reduces_per_microbatch: int  # collectives a stage runs per micro-batch
    p2p_bytes_per_token: float  # hidden states sent between stages, all stages
    bubble: float  # (S - 1) / (M + S - 1): each rank's idle share of a step
    decode_step_s: float  # one decode step of the batch: roofline per device + link time
    one_device_step_s: float  # the same step on one device
    speedup: float  # one_device_step_s / decode_step_s


def parallel_cost(
    s: ModelShape, weights: est.NumberFormat, kv: est.NumberFormat, hw: Hardware, layout: ParallelLayout, batch: int,
    context: int, act_bytes: int = 2,
) -> ParallelCost:  # fmt: skip
    tp, pp, m = layout.tensor_parallel_size, layout.pipeline_parallel_size, min(layout.microbatches, batch)
    bounds = stage_bounds(s.num_hidden_layers, pp)
    stage_layers = [stop - start for start, stop in bounds]
    per_device = max(device_weight_bytes(s, weights, tp, n, i == 0, i == pp - 1) for i, n in enumerate(stage_layers))
    heads = split_heads(s.num_attention_heads, s.num_key_value_heads, tp)
    kv_share = max(h.num_kv_heads for h in heads) / s.num_key_value_heads
    kv_per_token = est.kv_bytes_per_token(s, kv) * kv_share * max(stage_layers) / s.num_hidden_layers
    reduce_payload = all_reduce_bytes_per_token(s, stage_layers[0], True, act_bytes)
    num_reduces = 2 * stage_layers[0] + 1 if tp > 1 else 0
    one = est.roofline_time(est.decode_step(s, weights, kv, batch, context), hw, weights.name)
    # a stage's share of one micro-batch: 1/(tp * pp) of the work; then its collectives and its send
    stage_s = one / (tp * pp * m)
    bw, lat = layout.link_bandwidth, layout.link_latency_s
    rows = batch / m
    if tp > 1:
        stage_s += num_reduces * lat + 2 * (tp - 1) / tp * reduce_payload * rows / bw
        stage_s += lat + (tp - 1) / tp * rows * s.vocab_size * act_bytes / bw / pp  # the logits' all-gather
    if pp > 1:
        stage_s += lat + rows * s.hidden_size * act_bytes / bw
    step = (m + pp - 1) * stage_s
    return ParallelCost(
        weight_bytes_per_device=per_device,
        kv_bytes_per_token_per_device=kv_per_token,
        all_reduce_bytes_per_token=reduce_payload if tp > 1 else 0.0,
        all_reduces_per_microbatch=num_reduces,
        p2p_bytes_per_token=(pp - 1) * s.hidden_size * act_bytes,
        bubble=(pp - 1) / (m + pp - 1),
        decode_step_s=step,
        one_device_step_s=one,
        speedup=one / step,
    )
