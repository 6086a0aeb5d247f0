"""The sweeps behind `leanlm bench latency | throughput`, and their report: a markdown table plus PNG plots
(latency distribution, throughput against batch size, decode bandwidth use against the measured roofline)."""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from leanlm.analysis.bench import LatencySample, Repetitions, Runner, median, repeat
from leanlm.analysis.bench_tables import LatencyRow, ThroughputRow, latency_table, throughput_table, unmeasured
from leanlm.analysis.host import describe_machine, measure_memory_bandwidth
from leanlm.analysis.peer_runner import PROCESS_PEERS, PeerRunner, peer_notes, process_peer_runner


@dataclass(frozen=True)
class SuiteReport:
    """What `leanlm bench latency | throughput` made."""

    markdown: str  # the report (also written to the results directory)
    unmeasured: str | None  # why some points kept no repetition (the command then fails), or None


def prompts_from_text(tokenizer, text: str, lengths: list[int], seed: int) -> list[list[int]]:
    """Token prompts of the given lengths cut at random places from real text."""
    ids = tokenizer.encode(text[:400_000], add_special_tokens=False)
    rng = random.Random(seed)
    return [ids[(s := rng.randrange(0, len(ids) - n)) : s + n] for n in lengths]


def run_latency(
    runners: list[Runner],
    prompts: dict[int, list[list[int]]],
    output_lens: list[int],
    reps: int,
    bytes_per_token: dict[str, callable],
    bandwidth: float,
    threshold: float = 0.10,
) -> list[LatencyRow]:
    """Batch-1 latency for every runner, prompt length and output length. Each repetition gets a prompt of its
    own (prompts[length] holds reps + 1 of them, the first for the warm-up), so no prompt cache helps."""
    rows = []
    for prompt_len, prompt_list in prompts.items():
        for output_len in output_lens:
            for runner in runners:
                runner.latency(prompt_list[0], min(output_len, 8))  # warm-up: kernels, allocator
            results = {}
            for r in runners:
                fresh = iter(prompt_list[1:])
                results[r.name] = repeat(lambda r=r, fresh=fresh: r.latency(next(fresh), output_len), reps, threshold)
            for runner in runners:
                reps_ = results[runner.name]
                samples: list[LatencySample] = reps_.values
                tpot = median([s.tpot_s for s in samples])
                per_token = bytes_per_token[runner.name](prompt_len + output_len // 2)
                rows.append(
                    LatencyRow(
                        runner.name,
                        prompt_len,
                        output_len,
                        median([s.ttft_s for s in samples]) * 1000,
                        tpot * 1000,
                        1 / tpot,
                        per_token,
                        per_token / tpot / bandwidth,
                        [g * 1000 for s in samples for g in s.token_times_s],
                        len(samples),
                        len(reps_.discarded),
                    )
                )
    return rows


def run_throughput(
    runners: list[Runner | PeerRunner],
    prompts: list[list[int]],
    batch_sizes: list[int],
    output_len: int,
    reps: int,
    threshold: float = 0.10,
) -> list[ThroughputRow]:
    """Output tokens/s with `batch_size` requests submitted at once (the first batch_size prompts). Runners with a
    throughput_sweep (PeerRunners: a process of their own) run every batch size in one call."""
    results: dict[tuple[str, int], Repetitions] = {}
    for runner in runners:
        if sweep := getattr(runner, "throughput_sweep", None):
            for batch_size, reps_ in sweep(prompts, batch_sizes, output_len, reps, threshold).items():
                results[(runner.name, batch_size)] = reps_
    for batch_size in batch_sizes:
        batch = prompts[:batch_size]
        for runner in runners:
            if (runner.name, batch_size) not in results:
                runner.throughput(batch[:1], 4)  # warm-up
                results[(runner.name, batch_size)] = repeat(
                    lambda: runner.throughput(batch, output_len), reps, threshold
                )
    rows = []
    for batch_size in batch_sizes:
        for runner in runners:
            kept = results[(runner.name, batch_size)]
            rows.append(
                ThroughputRow(runner.name, batch_size, median(kept.values), len(kept.values), len(kept.discarded))
            )
    return rows


def write_report(out_dir: Path, title: str, command: str, lines: list[str], data: dict, plots: dict) -> str:
    """Markdown (report.md), JSON (results.json) and the PNG plots into out_dir; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    images = []
    for name, draw in plots.items():
        path = out_dir / f"{name}.png"
        draw(path)
        images.append(f"![{name}]({path.name})")
    body = [f"## {title}", "", f"Machine: {describe_machine()}. Command: `{command}`.", "", *lines, "", *images]
    text = "\n".join(body).rstrip() + "\n"
    (out_dir / "report.md").write_text(text)
    return text


def plot_latency(rows: list[LatencyRow], bandwidth: float):
    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        labels = [f"{r.runner}\n{r.prompt_len}+{r.output_len}" for r in rows]
        ax1.boxplot([r.token_times_ms or [float("nan")] for r in rows], showfliers=False)
        ax1.set_xticks(range(1, len(rows) + 1), labels, fontsize=7)
        ax1.set_ylabel("time per output token (ms)")
        ax1.set_title("batch-1 per-token latency")
        ax2.bar(range(len(rows)), [r.mbu * 100 for r in rows])
        ax2.set_xticks(range(len(rows)), labels, fontsize=7)
        ax2.set_ylabel("% of measured bandwidth")
        ax2.set_title(f"decode bandwidth use (roofline: {bandwidth / 1e9:.1f} GB/s)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return draw


def plot_throughput(rows: list[ThroughputRow]):
    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in dict.fromkeys(r.runner for r in rows):
            points = sorted((r.batch_size, r.output_tokens_per_s) for r in rows if r.runner == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests submitted together")
        ax.set_ylabel("output tokens/s")
        ax.set_title("offline throughput")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return draw


def as_data(rows) -> list[dict]:
    return [asdict(r) for r in rows]


# -- the commands ---------------------------------------------------------------------------------------


def check_peers(compare: list[str], throughput: bool) -> None:
    """Fail before any model loads: an unknown name, a missing package or environment, or a process peer asked
    for latency."""
    from leanlm.analysis.bench import PEERS

    unknown = sorted(set(compare) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peers {unknown}; --compare takes {', '.join(PEERS)}")
    process_peers = [c for c in compare if c in PROCESS_PEERS]
    if process_peers and not throughput:
        raise ValueError(f"{process_peers} run in processes of their own and measure throughput only")
    for spec in {PROCESS_PEERS[c][0] for c in process_peers}:
        if not spec.is_installed():
            raise ValueError(spec.missing_message())
    # The in-process peers' packages are optional (leanlm[peers]): a missing one fails here.
    if "hf" in compare:
        import transformers  # noqa: F401
    if "llama.cpp" in compare:
        import llama_cpp  # noqa: F401


def batch1_weight_elements(model) -> float:
    """Weight elements a batch-1 decode step reads: all of them, but of each MoE layer's experts only the top-k."""
    from leanlm.model.moe import moe_blocks

    total = sum(p.numel() for p in model.parameters())
    for block in moe_blocks(model):
        experts = sum(p.numel() for p in block.experts.parameters())
        total -= experts * (block.moe.num_experts - block.moe.top_k) / block.moe.num_experts
    return total


def build_runners(
    model: str, dtype: str, compare: list[str], max_context: int, hf_batch_size: int = 32, engine_options=None
):
    """Our runner plus the peers asked for, on the same model file; and, per in-process runner, the bytes one
    decode step reads at a given context (weights as that runner stores them, plus its KV cache). `engine_options`
    are LLM's (the bench command's engine flags); every in-process runner computes on their num_threads (default:
    every usable core, fixed, as the peers do: a repetition slowed by other processes is discarded, not adapted to)."""
    import torch

    from leanlm.analysis.bench import HFRunner, LeanLMRunner, LlamaCppRunner
    from leanlm.formats.inspect import ModelFormat, inspect
    from leanlm.llm import LLM

    options = dict(engine_options or {})
    threads = options["num_threads"] = options.get("num_threads") or len(os.sched_getaffinity(0))
    # No prefix caching: repetitions of a batch would otherwise reuse their own prompts' KV.
    options["enable_prefix_caching"] = False
    llm = LLM(model, dtype=dtype, progress=False, **options)
    cfg = llm.model_config
    element = torch.empty(0, dtype=llm.dtype).element_size()
    weights = batch1_weight_elements(llm.llm_engine.model) * element

    def kv_bytes(context: int, kv_element: int) -> float:
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_element * context

    runners = [LeanLMRunner(llm)]
    per_token = {"leanlm": lambda c: weights + kv_bytes(c, element)}
    source = inspect(model)
    path = source.path
    if "hf" in compare:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=llm.dtype).eval()
        runners.append(HFRunner(hf_model, pad_id=llm.get_tokenizer().eos_token_id or 0, batch_size=hf_batch_size))
        per_token["hf"] = per_token["leanlm"]
    if "llama.cpp" in compare:
        if source.format is not ModelFormat.GGUF:
            raise ValueError("llama.cpp needs a GGUF model; pass a GGUF file or a bundled model")
        runners.append(LlamaCppRunner(path, n_ctx=max_context, n_threads=threads))
        file_bytes = path.stat().st_size  # its weights as stored: the published quantization
        per_token["llama.cpp"] = lambda c: file_bytes + kv_bytes(c, 2)  # f16 KV cache
    max_num_seqs = llm.llm_engine.engine_config.max_num_seqs
    runners += [process_peer_runner(c, model, dtype, max_num_seqs) for c in compare if c in PROCESS_PEERS]
    return llm, runners, per_token


def _text(data: str | Path) -> str:
    """The prompt source: a text file (`leanlm bench` passes the packaged WikiText-2 test split by default)."""
    if not Path(data).is_file():
        raise ValueError(f"prompt data file {data} does not exist; pass an existing text file with --data")
    return Path(data).read_text(encoding="utf-8")


def latency_command(args) -> SuiteReport:
    prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    output_lens = [int(x) for x in args.output_lens.split(",")]
    compare = [c for c in args.compare.split(",") if c]
    check_peers(compare, throughput=False)
    text = _text(args.data)  # before the (slow) model loads
    llm, runners, per_token = build_runners(
        args.model, args.dtype, compare, max(prompt_lens) + max(output_lens) + 8, engine_options=args.engine_options
    )
    prompts = {
        n: prompts_from_text(llm.get_tokenizer(), text, [n] * (args.reps + 1), args.seed + n) for n in prompt_lens
    }
    bandwidth = measure_memory_bandwidth()
    rows = run_latency(runners, prompts, output_lens, args.reps, per_token, bandwidth, args.max_other_cpu)
    lines = [
        f"Model `{args.model}` ({args.dtype}); batch 1, greedy, exactly the output tokens asked for; "
        f"medians of {args.reps} repetitions; measured memory bandwidth {bandwidth / 1e9:.1f} GB/s. MBU = "
        "bytes one decode step reads (weights as each runner stores them, plus KV) / time per output token "
        "/ bandwidth.",
        "",
        *latency_table(rows),
    ]
    report = write_report(
        Path(args.results_dir),
        "Latency: batch 1",
        args.command,
        lines,
        {"bandwidth": bandwidth, "rows": as_data(rows)},
        {"latency": plot_latency(rows, bandwidth)},
    )
    return SuiteReport(report, unmeasured(rows, args.max_other_cpu))


def throughput_command(args) -> SuiteReport:
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    compare = [c for c in args.compare.split(",") if c]
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(max(batch_sizes))]
    check_peers(compare, throughput=True)
    text = _text(args.data)  # before the (slow) model loads
    llm, runners, _ = build_runners(
        args.model, args.dtype, compare, args.max_prompt + args.output_len + 8, engine_options=args.engine_options
    )
    prompts = prompts_from_text(llm.get_tokenizer(), text, lengths, args.seed)
    rows = run_throughput(runners, prompts, batch_sizes, args.output_len, args.reps, args.max_other_cpu)
    lines = [
        f"Model `{args.model}` ({args.dtype}); prompts of {args.min_prompt}-{args.max_prompt} tokens (uniform, "
        f"seed {args.seed}) cut from real text, {args.output_len} output tokens each, greedy; medians of "
        f"{args.reps} repetitions (discarded when other processes took over {args.max_other_cpu:.0%} of the CPUs); "
        "our prefix cache is off, so repeating a batch gains nothing. llama.cpp's Python API runs requests "
        "one after another (its batched path is its server: see the serving section).",
        *peer_notes(runners),
        "",
        *throughput_table(rows),
    ]
    report = write_report(
        Path(args.results_dir),
        "Offline throughput",
        args.command,
        lines,
        {"rows": as_data(rows)},
        {"throughput": plot_throughput(rows)},
    )
    return SuiteReport(report, unmeasured(rows, args.max_other_cpu))
