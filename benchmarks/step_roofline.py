"""Where a batched step's time goes, against its roofline: one LeanLM run of a batched_decode workload, every
engine step timed and split (decoder layers, head GEMM, sampler, the engine's Python), next to what the step's
arithmetic needs at the measured bf16 dot-product peak and what its bytes need at the measured memory bandwidth.

Per step, from the scheduler's output (leanlm.analysis.estimate's accounting):
- linear FLOPs: 2 * weights per computed token for the decoder, 2 * V * d per sampled row for the head;
- attention FLOPs: 4 * L * H * D per (query, key) pair, each query at its own position;
- weight bytes: every matrix read once a step at the run's weight format (the head when tied: the embedding);
- KV bytes: each scheduled request's cached context read once per layer, and its new rows written.
The roofline is max(FLOPs / peak, bytes / bandwidth). Steps are grouped into all-decode steps and steps that
compute prompt tokens (prefill, alone or mixed with decodes, as the scheduler chunks them).

    python benchmarks/step_roofline.py --workload short --batch 64 --weights bf16 --out docs/step-roofline.md
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from batched_decode import WORKLOADS, checkpoint, leanlm_llm  # benchmarks/

from leanlm import LLM, SamplingParams
from leanlm.analysis import estimate as est
from leanlm.analysis.host import CpuMonitor, describe_machine, measure_memory_bandwidth
from leanlm.analysis.model_shape import ModelShape, shape_from_config
from leanlm.kernels import cpu_gemm
from leanlm.loading.registry import DEFAULT_MODEL

# --weights -> (what LLM loads, dequantize the GGUF, the linears' format for the byte count)
WEIGHTS = {
    "bf16": (None, True, est.weight_format("bf16")),
    "codes": (None, False, est.NumberFormat("q4_1", 4, 32, zero_bits=16)),
    "int8": ("int8", False, est.weight_format("int8")),
    "w8a8": ("w8a8", False, est.weight_format("int8")),
}
PARTS = ("layers", "head", "sampler", "engine")  # measured parts of a step; "engine": schedule, update, outputs


@dataclass
class StepNeeds:
    """What one step's work needs, summed over its tokens."""

    linear_flops: float = 0.0
    attention_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0


@dataclass
class Phase:
    """Totals of the steps of one kind."""

    steps: int = 0
    tokens: int = 0
    wall: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    needs: StepNeeds = field(default_factory=StepNeeds)
    roofline: float = 0.0  # sum of the steps' max(FLOPs / peak, bytes / bandwidth)


def step_needs(s: ModelShape, fmt: est.NumberFormat, kv_row: float, so) -> tuple[bool, StepNeeds]:
    """(does the step compute prompt tokens, its FLOPs and bytes); so is its SchedulerOutput, read before the step
    advances the requests. Rows sample where a request's chunk reaches its last token, as the runner lays out."""
    needs = StepNeeds(weight_bytes=est.streamed_weight_bytes(s, fmt, so.total_num_scheduled_tokens))
    per_pair = est.attention_flops_per_token(s, 1)
    decoder = est.matmul_flops_per_token(s, with_logits=False)
    prompt = False
    for request, n in zip(so.scheduled_requests, so.num_scheduled_tokens):
        start = request.num_computed_tokens  # cached tokens; query i attends to start + i + 1 keys
        prompt |= start < request.num_prompt_tokens
        needs.linear_flops += n * decoder
        needs.attention_flops += per_pair * (n * start + n * (n + 1) / 2)
        needs.kv_bytes += (start + n) * kv_row  # the cached rows read once, the new ones written
        if start + n == request.num_tokens:
            needs.linear_flops += 2 * s.vocab_size * s.hidden_size  # its head row
    return prompt, needs


class StepTimer:
    """Wraps an LLM's engine step, model forward, head and sampler, and records each step into a Phase."""

    def __init__(self, llm: LLM, fmt: est.NumberFormat, peak_flops: float, bandwidth: float) -> None:
        engine = llm.llm_engine
        runner = engine.model_runner
        self.shape = shape_from_config(runner.model.config)
        self.fmt, self.peak, self.bandwidth = fmt, peak_flops, bandwidth
        self.kv_row = est.kv_bytes_per_token(self.shape, est.kv_format("bf16", self.shape.head_dim))  # K+V, all layers
        self.phases: dict[str, Phase] = defaultdict(Phase)
        self.current: dict[str, float] = {}
        self.pending: tuple[bool, StepNeeds, int] | None = None
        self._wrap(runner.model, "forward", "layers")
        self._wrap(runner.model, "compute_logits", "head")
        self._wrap(runner, "sampler", "sampler")
        self._wrap_schedule(engine.scheduler)
        self._wrap_step(engine)

    def _wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.current[part] = self.current.get(part, 0.0) + time.perf_counter() - t0
            return out

        setattr(owner, name, timed)  # an instance attribute: module.__call__ finds it before the class's

    def _wrap_schedule(self, scheduler) -> None:
        inner = scheduler.schedule

        def schedule():
            so = inner()
            if not so.is_empty:
                self.pending = (*step_needs(self.shape, self.fmt, self.kv_row, so), so.total_num_scheduled_tokens)
            return so

        scheduler.schedule = schedule

    def _wrap_step(self, engine) -> None:
        inner = engine.step

        def step():
            self.current, self.pending = {}, None
            t0 = time.perf_counter()
            out = inner()
            if self.pending is not None:
                self.record(time.perf_counter() - t0, *self.pending)
            return out

        engine.step = step

    def record(self, wall: float, prompt: bool, needs: StepNeeds, tokens: int) -> None:
        phase = self.phases["prompt" if prompt else "decode"]
        phase.steps += 1
        phase.tokens += tokens
        phase.wall += wall
        measured = {part: self.current.get(part, 0.0) for part in PARTS[:-1]}
        measured["engine"] = wall - sum(measured.values())
        for part, seconds in measured.items():
            phase.parts[part] += seconds
        for name in vars(needs):
            setattr(phase.needs, name, getattr(phase.needs, name) + getattr(needs, name))
        flops = needs.linear_flops + needs.attention_flops
        phase.roofline += max(flops / self.peak, (needs.weight_bytes + needs.kv_bytes) / self.bandwidth)


def run_workload(args, peak: float, bandwidth: float) -> StepTimer:
    """One timed pass of the workload at one batch cap, after a warm-up pass (which also fills a prefix cache)."""
    wl = WORKLOADS[args.workload]
    source, dequantize, fmt = WEIGHTS[args.weights]
    model = str(checkpoint(source, args.model)) if source else args.model
    n = max(args.num_prompts, args.batch)
    prompts = wl.prompts(2 * n if wl.shared else n, seed=0)
    warmup, timed_prompts = (prompts[:n], prompts[n:]) if wl.shared else (prompts[: args.batch], prompts)
    llm = leanlm_llm(model, args.batch, dequantize, prefix_caching=wl.shared)
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    timer = StepTimer(llm, fmt, peak * 1e9, bandwidth)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with CpuMonitor() as monitor:
        t0 = time.perf_counter()
        llm.generate(timed_prompts, params, use_tqdm=True)
        timer.total = time.perf_counter() - t0
    timer.other_cpu = monitor.sample.other_share
    return timer


def report(timer: StepTimer, args, peak: float, bandwidth: float) -> list[str]:
    wl = WORKLOADS[args.workload]
    out_tokens = max(args.num_prompts, args.batch) * args.output_len
    lines = [
        f"### {args.workload} ({wl.describe()}), batch cap {args.batch}, {args.weights} weights",
        "",
        f"{out_tokens} output tokens in {timer.total:.2f} s ({out_tokens / timer.total:.0f} tok/s). Measured: "
        f"bf16 dot-product peak {peak:.0f} GFLOP/s, read bandwidth {bandwidth / 1e9:.1f} GB/s. Other processes "
        f"used {100 * timer.other_cpu:.1f}% of the CPU during the run.",
        "",
        "| steps | count | tokens | wall s | layers | head | sampler | engine | GFLOP | arithmetic s | "
        "weight + KV GB | bytes s | roofline s | wall / roofline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("decode", "prompt"):
        ph = timer.phases.get(name)
        if ph is None or not ph.steps:
            continue
        flops = ph.needs.linear_flops + ph.needs.attention_flops
        gbytes = (ph.needs.weight_bytes + ph.needs.kv_bytes) / 1e9
        shares = [f"{100 * ph.parts[p] / ph.wall:.0f}%" for p in PARTS]
        lines.append(
            f"| {name} | {ph.steps} | {ph.tokens} | {ph.wall:.2f} | "
            + " | ".join(shares)
            + f" | {flops / 1e9:.0f} | {flops / (peak * 1e9):.2f} | {ph.needs.weight_bytes / 1e9:.1f} + "
            f"{ph.needs.kv_bytes / 1e9:.1f} | {gbytes * 1e9 / bandwidth:.2f} | {ph.roofline:.2f} | "
            f"{ph.wall / ph.roofline:.1f}x |"
        )
    dec = timer.phases.get("decode")
    if dec is not None and dec.steps:
        attn = dec.needs.attention_flops / (peak * 1e9)
        lin = dec.needs.linear_flops / (peak * 1e9)
        kv = dec.needs.kv_bytes / bandwidth
        lines += [
            "",
            f"Decode steps: the linears need {lin:.2f} s at the peak and attention {attn:.2f} s of arithmetic or "
            f"{kv:.2f} s of KV reads at the bandwidth; the layers took {dec.parts['layers']:.2f} s and the head "
            f"{dec.parts['head']:.2f} s.",
        ]
    if args.weights == "w8a8":
        lines += [
            "",
            "W8A8's linears run int8 x int8 on vpdpbusd, which does twice the work of vdpbf16ps an instruction: the "
            "bf16 peak used here is not their bound, so a ratio under 1 is possible.",
        ]
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--weights", default="bf16", choices=sorted(WEIGHTS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    args = ap.parse_args()
    peak, bandwidth = cpu_gemm.measure_dot_peak(), measure_memory_bandwidth()
    timer = run_workload(args, peak, bandwidth)
    lines = report(timer, args, peak, bandwidth)
    print("\n".join(lines))
    if args.out:
        header = [] if args.out.exists() else ["# Step roofline (`benchmarks/step_roofline.py`)", ""]
        header += [f"Machine: {describe_machine()}.", ""]
        with args.out.open("a") as f:
            f.write("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
