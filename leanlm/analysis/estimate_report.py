"""`leanlm estimate` output: one settings dataclass -> a JSON-ready report dict -> a text table or a roofline PNG.
The numbers all come from `leanlm.analysis.estimate`; this module only chooses the points and prints them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from leanlm.analysis import estimate as est
from leanlm.analysis.all_to_all import INTER_NODE_LINK, ExpertParallelLayout
from leanlm.analysis.estimate_long_context import BoundedAttention
from leanlm.analysis.hardware_profiles import Hardware
from leanlm.analysis.long_context_report import long_context_lines, long_context_report
from leanlm.analysis.model_shape import ModelShape
from leanlm.analysis.moe_report import moe_lines, moe_report
from leanlm.analysis.parallel_estimate import CPU_LINK, LINKS, ParallelLayout, parallel_cost
from leanlm.analysis.text_table import si as _si
from leanlm.analysis.text_table import table as _table


@dataclass(frozen=True)
class EstimateSettings:
    """What to estimate for: formats, batch and lengths, and optional budget and measured throughput."""

    dtype: str = field(default="bf16", metadata={"help": "weight format: fp32 | bf16 | fp16 | fp8 | int8 | int4"})
    kv_dtype: str | None = field(
        default=None, metadata={"help": "KV cache format (default: --dtype when it is a float format, else bf16)"}
    )
    group_size: int = field(default=128, metadata={"help": "int4 weights: values per fp16 scale"})
    zero_bits: int = field(
        default=0, metadata={"help": "int4 weights: bits of a zero point per group (asymmetric); 0 = symmetric"}
    )
    batch: int = field(default=1, metadata={"help": "sequences decoded together"})
    context: int = field(
        default=2048, metadata={"help": "tokens each sequence attends to when decoding (prompt + generated)"}
    )
    prompt_len: int = field(default=512, metadata={"help": "tokens of one prompt's prefill"})
    memory_budget_gb: float | None = field(
        default=None, metadata={"help": "memory for the largest-batch estimate, in GB (default: the hardware's memory)"}
    )
    tokens_per_s: float | None = field(
        default=None, metadata={"help": "measured decode throughput, summed over the batch: reports MBU and MFU"}
    )
    tensor_parallel_size: int = field(default=1, metadata={"help": "devices each layer is split across"})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "pipeline stages the layers are split into"})
    pipeline_microbatches: int | None = field(
        default=None, metadata={"help": "micro-batches in flight through the stages (default: the stages)"}
    )
    link_bandwidth_gbs: float | None = field(
        default=None, metadata={"help": "GB/s between two devices (default: NVLink of the GPU profile, or loopback)"}
    )
    link_latency_us: float | None = field(
        default=None, metadata={"help": "microseconds one collective takes however small (default: per profile)"}
    )
    expert_coverage: float = field(
        default=0.99, metadata={"help": "MoE: share of each layer's experts a decode step must read to read them all"}
    )
    expert_parallel_size: int = field(
        default=1, metadata={"help": "MoE: ranks the experts are split across (estimates the all-to-all)"}
    )
    expert_parallel_nodes: int = field(
        default=1,
        metadata={"help": "MoE: nodes those ranks span, each holding the same number (hierarchical all-to-all)"},
    )
    inter_node_bandwidth_gbs: float | None = field(
        default=None, metadata={"help": "GB/s from one rank to another node (default 50: 400 Gb/s InfiniBand)"}
    )
    inter_node_latency_us: float | None = field(
        default=None, metadata={"help": "microseconds one message to another node takes (default 10)"}
    )
    attention_window: int | None = field(
        default=None,
        metadata={"help": "long context: KV bytes and attention FLOPs at 4k-128k tokens when each query reads the "
                  "last N tokens (plus --attention-sinks), beside full attention"},
    )  # fmt: skip
    attention_sinks: int = field(
        default=0,
        metadata={"flags": ("--sinks",), "help": "with --attention-window: the first N tokens every query reads"},
    )  # the flag generate and serve take; --sinks is its older spelling
    kv_budget: int | None = field(
        default=None,
        metadata={"help": "long context: the same table when at most N tokens per sequence stay cached (prefill "
                  "still attends to the whole prompt)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        est.weight_format(self.dtype)  # raises with the list of formats
        if self.kv_dtype is not None:
            est.kv_format(self.kv_dtype, 1)
        for name in ("group_size", "batch", "context", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.zero_bits < 0:
            raise ValueError(f"--zero-bits must be >= 0, got {self.zero_bits}")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ValueError(f"--memory-budget-gb must be > 0, got {self.memory_budget_gb}")
        if self.tokens_per_s is not None and self.tokens_per_s <= 0:
            raise ValueError(f"--tokens-per-s must be > 0, got {self.tokens_per_s}")
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.pipeline_microbatches or 1) < 1:
            raise ValueError("--tensor-parallel-size, --pipeline-parallel-size, --pipeline-microbatches must be >= 1")
        if not 0 < self.expert_coverage < 1:
            raise ValueError(f"--expert-coverage must be in (0, 1), e.g. 0.99, got {self.expert_coverage}")
        if min(self.expert_parallel_size, self.expert_parallel_nodes) < 1:
            raise ValueError("--expert-parallel-size and --expert-parallel-nodes must be >= 1")
        self.bounded_attention()  # raises on a bad --attention-window, --attention-sinks or --kv-budget

    def bounded_attention(self) -> BoundedAttention:
        return BoundedAttention(self.attention_window, self.attention_sinks, self.kv_budget)

    def _intra_link(self, hw: Hardware) -> tuple[float, float]:
        bandwidth, latency = next((v for k, v in LINKS.items() if k in hw.name.lower()), CPU_LINK)
        return (
            self.link_bandwidth_gbs * 1e9 if self.link_bandwidth_gbs else bandwidth,
            self.link_latency_us * 1e-6 if self.link_latency_us is not None else latency,
        )

    def expert_parallel_layout(self, hw: Hardware) -> ExpertParallelLayout | None:
        if self.expert_parallel_size == 1 and self.expert_parallel_nodes == 1:
            return None
        bandwidth, latency = INTER_NODE_LINK
        return ExpertParallelLayout(
            self.expert_parallel_size,
            self.expert_parallel_nodes,
            *self._intra_link(hw),
            self.inter_node_bandwidth_gbs * 1e9 if self.inter_node_bandwidth_gbs else bandwidth,
            self.inter_node_latency_us * 1e-6 if self.inter_node_latency_us is not None else latency,
        )

    def parallel_layout(self, hw: Hardware) -> ParallelLayout | None:
        if self.tensor_parallel_size * self.pipeline_parallel_size == 1:
            return None
        return ParallelLayout(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.pipeline_microbatches or self.pipeline_parallel_size,
            *self._intra_link(hw),
        )

    def formats(self, shape: ModelShape) -> tuple[est.NumberFormat, est.NumberFormat]:
        weights = est.weight_format(self.dtype, self.group_size, self.zero_bits)
        kv_name = self.kv_dtype or (weights.name if weights.is_float else "bf16")
        return weights, est.kv_format(kv_name, shape.head_dim)


def _step_row(cost: est.StepCost, hw: Hardware, dtype: str) -> dict:
    seconds = est.roofline_time(cost, hw, dtype)
    new_tokens = cost.num_tokens
    return {
        **asdict(cost),
        "intensity": cost.intensity,
        "time_s": seconds,
        "bound": "memory" if est.is_memory_bound(cost, hw, dtype) else "compute",
        "tokens_per_s": new_tokens / seconds,
    }


def decode_batches(settings: EstimateSettings, largest: int) -> list[int]:
    """The batch sizes the table and the plot show: 1, 8, 64, the asked one and the largest that fits."""
    return sorted({1, 8, 64, settings.batch, *([largest] if largest > 0 else [])})


def build_report(shape: ModelShape, source: str, hw: Hardware, settings: EstimateSettings) -> dict:
    weights, kv = settings.formats(shape)
    p = est.param_counts(shape)
    s = settings
    budget = s.memory_budget_gb * 1e9 if s.memory_budget_gb is not None else float(hw.memory_bytes)
    largest = est.max_batch(shape, weights, kv, s.context, s.prompt_len, budget)
    report = {
        "model": {**asdict(shape), "source": source},
        "hardware": {**asdict(hw), "ridge_point": hw.peak_flops / hw.memory_bandwidth},
        "settings": {
            **asdict(s),
            "kv_dtype": kv.name,
            "bits_per_weight": weights.bits_per_value,
            "kv_bits_per_value": kv.bits_per_value,
        },
        "params": {**asdict(p), "total": p.total, "active": p.active},
        "memory": {
            "weight_bytes": est.weight_bytes(shape, weights),
            "kv_bytes_per_token": est.kv_bytes_per_token(shape, kv),
            "kv_cache_bytes": est.kv_cache_bytes(shape, kv, s.batch, s.context),
            "activation_bytes": est.peak_activation_bytes(
                shape, max(s.batch, s.prompt_len), s.context, logits_rows=s.batch
            ),
            "total_bytes": est.serving_memory_bytes(shape, weights, kv, s.batch, s.context, s.prompt_len),
            "budget_bytes": budget,
            "max_batch": largest,
        },
        "flops_per_token": {
            "decode_short": est.decode_flops_per_token(shape, 1),
            "decode_at_context": est.decode_flops_per_token(shape, s.context),
            "prefill_prompt": est.prefill_flops(shape, s.prompt_len),
        },
        "steps": [_step_row(est.prefill_step(shape, weights, kv, s.batch, s.prompt_len), hw, weights.name)]
        + [
            _step_row(est.decode_step(shape, weights, kv, b, s.context), hw, weights.name)
            for b in decode_batches(s, largest)
        ],
    }
    act_bytes = 4 if weights.name == "fp32" else 2
    experts = s.expert_parallel_layout(hw)
    if experts is not None and not shape.is_moe:
        raise ValueError(f"--expert-parallel-size: {shape.name} has no experts; drop the flag or pick an MoE model")
    if shape.is_moe:
        report["moe"] = moe_report(shape, weights, s.batch, s.expert_coverage, experts, act_bytes)
    layout = s.parallel_layout(hw)
    if layout is not None:
        cost = parallel_cost(shape, weights, kv, hw, layout, s.batch, s.context, act_bytes)
        report["parallel"] = {**asdict(layout), **asdict(cost)}
    if s.bounded_attention().any:
        report["long_context"] = long_context_report(shape, kv, s.bounded_attention())
    if s.tokens_per_s is not None:
        u = est.decode_utilization(shape, weights, kv, hw, s.batch, s.context, s.tokens_per_s)
        report["utilization"] = {
            "tokens_per_s": s.tokens_per_s,
            "batch": s.batch,
            "context": s.context,
            "mbu": u.mbu,
            "mfu": u.mfu,
        }
    return report


# ---------------------------------------------------------------------------------------------- text


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:,.0f}"


def format_report(r: dict) -> str:
    m, hw, s, p, mem = r["model"], r["hardware"], r["settings"], r["params"], r["memory"]
    moe = f", MoE {m['num_experts']} experts top-{m['experts_per_token']}" if m["num_experts"] > 1 else ""
    if moe and m["shared_expert_intermediate_size"]:
        moe += f" + a shared expert of {m['shared_expert_intermediate_size']}"
    if moe and m["num_moe_layers"] is not None:
        moe += f" in {m['num_moe_layers']} layers (the others: FFN {m['dense_intermediate_size']})"
    lines = [
        f"model     {m['name']} ({m['source']}): {m['num_hidden_layers']} layers, d={m['hidden_size']}, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads of {m['head_dim']}, "
        f"FFN {m['intermediate_size']} ({'gated' if m['mlp_gated'] else 'plain'}){moe}, vocab {m['vocab_size']}"
        f"{', tied embeddings' if m['tie_word_embeddings'] else ''}",
        f"hardware  {hw['name']}: {_si(hw['peak_flops'], 'FLOP/s')} bf16, {_si(hw['peak_flops_fp32'], 'FLOP/s')} fp32, "
        f"{_si(hw['memory_bandwidth'], 'B/s')}, {_si(hw['memory_bytes'], 'B')}; "
        f"ridge {hw['ridge_point']:.0f} FLOP/byte "
        f"({hw['source']})",
        f"settings  weights {s['dtype']} ({s['bits_per_weight']:g} bits), KV {s['kv_dtype']} "
        f"({s['kv_bits_per_value']:g} bits), batch {s['batch']}, context {s['context']}, prompt {s['prompt_len']}",
        "",
    ]
    parts = [
        ("embed_tokens", "embeddings"),
        ("position_embeddings", "position embeddings"),
        ("lm_head", "lm_head (untied)"),
        ("attention", "attention q/k/v/o"),
        ("mlp", "MLP (all experts)"),
        ("mlp_active", "MLP active per token"),
        ("mlp_shared", "of which shared experts / dense MLPs"),
        ("router", "router"),
        ("biases", "biases"),
        ("norms", "norms"),
    ]
    if m["num_experts"] == 1:
        parts[4] = ("mlp", "MLP")
    rows = [
        [label, f"{p[key]:,}", f"{p[key] / p['total']:.1%}"]
        for key, label in parts
        if p[key] and not (key == "mlp_active" and p[key] == p["mlp"])
    ]
    rows.append(["total", f"{p['total']:,}", "100.0%"])
    if p["active"] != p["total"]:
        rows.append(["active per token", f"{p['active']:,}", f"{p['active'] / p['total']:.1%}"])
    lines += [_table(["parameters", "count", "share"], rows), ""]
    budget_label = f"largest batch in {_si(mem['budget_bytes'], 'B')}"
    rows = [
        ["weights", _si(mem["weight_bytes"], "B")],
        ["KV cache per token", _si(mem["kv_bytes_per_token"], "B")],
        [f"KV cache, {s['batch']} x {s['context']} tokens", _si(mem["kv_cache_bytes"], "B")],
        ["peak activations", _si(mem["activation_bytes"], "B")],
        ["total", _si(mem["total_bytes"], "B")],
        [budget_label, str(mem["max_batch"]) if mem["max_batch"] else "0 (does not fit)"],
    ]
    lines += [_table(["memory", "bytes"], rows), ""]
    rows = [
        [
            f"{st['phase']} b={st['batch']} {'x' if st['phase'] == 'prefill' else '@'} {st['context']}",
            _si(st["flops"]),
            _si(st["bytes"], "B"),
            f"{st['intensity']:.1f}",
            _ms(st["time_s"]),
            st["bound"],
            f"{st['tokens_per_s']:,.1f}",
        ]
        for st in r["steps"]
    ]
    lines.append(_table(["step (roofline)", "FLOPs", "bytes", "FLOP/B", "ms", "bound", "tokens/s"], rows))
    if "moe" in r:
        lines += ["", *moe_lines(r["moe"], m["num_experts"])]
    if "parallel" in r:
        lines += ["", *_parallel_lines(r["parallel"], s)]
    if "long_context" in r:
        lines += ["", *long_context_lines(r["long_context"])]
    if "utilization" in r:
        u = r["utilization"]
        lines += [
            "",
            f"measured {u['tokens_per_s']:g} tokens/s decode (batch {u['batch']}, context {u['context']}): "
            f"MBU {u['mbu']:.1%}, MFU {u['mfu']:.2%}",
        ]
    return "\n".join(lines)


def _parallel_lines(par: dict, s: dict) -> list[str]:
    tp, pp = par["tensor_parallel_size"], par["pipeline_parallel_size"]
    rows = [
        ["weights per device (largest)", _si(par["weight_bytes_per_device"], "B")],
        ["KV cache per token per device", _si(par["kv_bytes_per_token_per_device"], "B")],
        ["all-reduce payload per token (a stage)", _si(par["all_reduce_bytes_per_token"], "B")],
        ["all-reduces per micro-batch (a stage)", str(par["all_reduces_per_microbatch"])],
        ["stage-to-stage bytes per token", _si(par["p2p_bytes_per_token"], "B")],
        [f"pipeline bubble ({par['microbatches']} micro-batches)", f"{par['bubble']:.1%}"],
        [f"decode step b={s['batch']} @ {s['context']}", _ms(par["decode_step_s"])],
        ["the same step on one device", _ms(par["one_device_step_s"])],
        ["speedup", f"{par['speedup']:.2f}x"],
    ]
    link = f"links {_si(par['link_bandwidth'], 'B/s')}, {par['link_latency_s'] * 1e6:g} us per collective"
    return [_table([f"TP={tp} x PP={pp} ({link})", "value"], rows)]


# ---------------------------------------------------------------------------------------------- plot


def plot_roofline(r: dict, path: str | Path) -> None:
    """Attainable FLOP/s against arithmetic intensity (log-log), the ridge point, and the report's steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hw = r["hardware"]
    peak = hw["peak_flops_fp32"] if r["settings"]["dtype"] == "fp32" else hw["peak_flops"]
    ridge = peak / hw["memory_bandwidth"]
    points = [st["intensity"] for st in r["steps"]]
    x = np.logspace(np.log10(min(0.1, min(points) / 2)), np.log10(max(ridge * 20, max(points) * 2)), 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(x, np.minimum(peak, x * hw["memory_bandwidth"]), color="black", label=hw["name"])
    ax.axvline(ridge, color="gray", linestyle=":", label=f"ridge {ridge:.0f} FLOP/B")
    for st in r["steps"]:
        attained = st["flops"] / st["time_s"]
        marker, color = ("s", "tab:red") if st["phase"] == "prefill" else ("o", "tab:blue")
        ax.loglog(st["intensity"], attained, marker, color=color)
        label = f"prefill b={st['batch']}" if st["phase"] == "prefill" else f"decode b={st['batch']}"
        ax.annotate(label, (st["intensity"], attained), textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    s = r["settings"]
    ax.set_title(f"{r['model']['name']}, weights {s['dtype']}, KV {s['kv_dtype']}, context {s['context']}")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
