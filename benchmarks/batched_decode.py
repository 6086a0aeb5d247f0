"""Batched decode on the CPU: the linear kernels against the measured vdpbf16ps peak, and offline throughput
of the short-prompt workload at several batch sizes, LeanLM next to HF transformers, in one run.

Workloads (issue 16), `--workload`: "short", 64 prompts of 16-32 tokens (fixed seed; as many as the cap where
that is more); "mix", 16-512 tokens; "shared-prefix", 64 users whose 16-32 token prompts follow one 1024-token
system prompt, run with every prefix cache on (LeanLM, OpenVINO, vLLM; HF has none) and user prompts of their own
in each repetition, after a warm-up that caches the system prompt. 128 greedy output tokens each, the engine
capped at `batch` running requests (HF: padded batches of `batch`, sorted by length). Engines:
- LeanLM on the bundled GGUF as shipped (Q4_1 linears on their 4-bit codes, the tied Q8_0 embedding as an int8
  head);
- LeanLM on the same file dequantized to bf16 (`--dequantize-gguf`), and RTN checkpoints of it at int8 (per
  channel, head too) and int4 g64 (head at int8), and a SmoothQuant W8A8 one (per-token int8 activations on
  the VNNI kernel; head int8 weight-only), to compare with OpenVINO's IRs at the same precision (OpenVINO's
  CPU plugin quantizes the activations of its int8 and int4 layers to int8 on the fly, in groups of 32, by
  default: its DYNAMIC_QUANTIZATION_GROUP_SIZE, reported); and the Q4_1 codes, int8 and int4 rows again with
  `act_quant="int8"` (W4A8 / W8A8-dynamic: int8 activations in groups of 32, as OpenVINO and llama.cpp do);
- HF transformers on a dense bf16 safetensors directory written from the dequantized model;
- llama.cpp's llama-batched-bench on the same GGUF (when benchmarks/build_llama_server.sh has built it):
  `batch` sequences of a 24-token prompt (the workload's mean) and 128 generated tokens each, 2 threads;
  its output tok/s is batch * 128 / (prompt time + generation time), as ours counts;
- OpenVINO GenAI's continuous-batching LLMPipeline on IR exports of the dense directory (fp16, int8 and int4 g64
  weights) and vLLM's CPU build on the dense bf16 directory, each in its own virtual environment
  (`make peers-openvino`, `make peers-vllm`) through a worker process (leanlm/analysis/peer_process.py), on the
  same prompts, capped at `batch` running requests; `--peers` picks them (default: those set up).
Every timed repetition records the CPU share other processes used (/proc/stat; a peer's worker measures its own
process tree); repetitions above --max-other-cpu are discarded and counted.

    python benchmarks/batched_decode.py --out docs/batched-decode.md
    python benchmarks/batched_decode.py --workload mix --linear-rows '' --out docs/batched-decode-mix.md
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from quantized_decode import quantized_dir  # benchmarks/: the same RTN recipes as the batch-1 benchmark

from leanlm import LLM, SamplingParams
from leanlm.analysis.bench import HFRunner
from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.peer_models import ensure_dense_dir, ensure_openvino_ir
from leanlm.analysis.peer_process import OPENVINO, VLLM, PeerBatch, PeerRequest, run_peer
from leanlm.analysis.peers import PEERS_DIR
from leanlm.kernels import cpu_a8, cpu_gemm, cpu_w8a8
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model

LLAMA_BATCHED_BENCH = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-batched-bench"

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576)}
SHAPES |= {"down 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}
# Peers in environments of their own: --peers name -> (environment, OpenVINO weight format or None: dense bf16).
PROCESS_PEERS = {"ov-fp16": (OPENVINO, "fp16"), "ov-int8": (OPENVINO, "int8"), "ov-int4": (OPENVINO, "int4")}
PROCESS_PEERS |= {"vllm": (VLLM, None)}
IN_PROCESS = ("codes", "codes-a8", "bf16", "int8", "int8-a8", "w8a8", "int4", "int4-a8", "hf", "llama.cpp")
# (numerator, denominator) columns of the ratio part of the table
RATIOS = (("codes", "hf"), ("bf16", "hf"), ("codes", "llama.cpp"), ("bf16", "ov-fp16"), ("int8", "ov-int8"))
RATIOS += (("w8a8", "ov-int8"), ("int4", "ov-int4"), ("bf16", "vllm"), ("codes-a8", "llama.cpp"))
RATIOS += (("int8-a8", "ov-int8"), ("int4-a8", "ov-int4"))
HEADERS = {"codes": "LeanLM, the GGUF's codes, 16-bit act", "bf16": "LeanLM, bf16 (dequantized)", "hf": "HF dense bf16"}
HEADERS |= {"int8": "LeanLM int8 RTN, 16-bit act", "int4": "LeanLM int4 g64 RTN (head int8), 16-bit act"}
HEADERS |= {"w8a8": "LeanLM W8A8 SmoothQuant (head int8)", "codes-a8": "LeanLM, the GGUF's codes, int8 act"}
HEADERS |= {"int8-a8": "LeanLM int8 RTN, int8 act", "int4-a8": "LeanLM int4 g64 RTN, int8 act"}
HEADERS |= {"llama.cpp": "llama.cpp, the same GGUF", "ov-fp16": "OpenVINO fp16 IR", "ov-int8": "OpenVINO int8 IR"}
HEADERS |= {"ov-int4": "OpenVINO int4 g64 IR", "vllm": "vLLM CPU bf16"}
SHORT = {"hf": "HF", "ov-fp16": "OpenVINO fp16", "ov-int8": "OpenVINO int8", "ov-int4": "OpenVINO int4", "vllm": "vLLM"}
SYSTEM_PROMPT_LEN = 1024  # the shared-prefix workload's system prompt, in tokens


@dataclass(frozen=True)
class Workload:
    """Prompts of `min_len`-`max_len` random tokens (after a shared system prompt of `prefix_len`), and how the
    engines run them. With a shared prefix every engine that has a prefix cache runs with it on, and each
    repetition gets user prompts of its own (the warm-up's set caches the system prompt, as a server's would);
    otherwise prefix caches are off, since repetitions resubmit the same prompts."""

    name: str
    min_len: int
    max_len: int
    prefix_len: int
    batches: str  # default --batches
    llama_cpp_prompt: int  # llama-batched-bench's prompt length (it takes one length; for the mix, the mean)

    @property
    def shared(self) -> bool:
        return self.prefix_len > 0

    def describe(self) -> str:
        user = f"{self.min_len}-{self.max_len} tokens"
        if self.shared:
            return f"a shared {self.prefix_len}-token system prompt + {user} (prefix caches on)"
        return user

    def prompts(self, n: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        system = [rng.randrange(100, 40000) for _ in range(self.prefix_len)]
        return [system + [rng.randrange(100, 40000) for _ in range(rng.randint(self.min_len, self.max_len))]
                for _ in range(n)]  # fmt: skip


WORKLOADS = {
    "short": Workload("short", 16, 32, 0, "1,8,32,64,128", 24),
    "mix": Workload("mix", 16, 512, 0, "8,32,64", 264),
    "shared-prefix": Workload("shared-prefix", 16, 32, SYSTEM_PROMPT_LEN, "16,64", SYSTEM_PROMPT_LEN + 24),
}


def gflops(fn, m: int, n: int, k: int, min_seconds: float = 0.15) -> float:
    """Best of 3 timed runs, each repeating fn until min_seconds passed."""
    fn()
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_seconds:
            fn()
            reps += 1
        best = max(best, 2 * m * n * k * reps / elapsed / 1e9)
    return best


def linear_table(rows: list[int]) -> list[str]:
    peak = cpu_gemm.measure_dot_peak()
    lines = [
        f"Measured vdpbf16ps peak on {torch.get_num_threads()} threads: **{peak:.0f} GFLOP/s** "
        "(register-only dot-product chains). GFLOP/s of one linear, weights hot in cache, "
        "torch `F.linear` (oneDNN) / LeanLM packed kernel (% of peak) / LeanLM W8A8 VNNI kernel (GOP/s, the "
        "per-token quantization of x included) / LeanLM int4 g64 with int8 activations in groups of 32 "
        "(`--act-quant int8`, gemm_a8; GOP/s, quantization included):",
        "",
        "| rows | " + " | ".join(SHAPES) + " |",
        "|---:|" + "---:|" * len(SHAPES),
    ]
    for m in rows:
        cells = []
        for n, k in SHAPES.values():
            x = torch.randn(m, k).to(torch.bfloat16)
            w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
            packed = cpu_gemm.pack(w)
            ours = gflops(lambda: cpu_gemm.gemm(x, packed), m, n, k)
            theirs = gflops(lambda: F.linear(x, w), m, n, k)
            cell = f"{theirs:.0f} / **{ours:.0f}** ({100 * ours / peak:.0f}%)"
            if cpu_w8a8.is_available():
                codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
                packed8 = cpu_w8a8.pack(codes, torch.rand(n) / k)
                cell += f" / {gflops(lambda: cpu_w8a8.gemm(x, packed8), m, n, k):.0f}"
            if cpu_a8.is_available():
                q4, scales = torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // 64) / k
                packed4 = cpu_a8.pack_int4(q4, scales, -8 * scales, 64)
                cell += f" / {gflops(lambda: cpu_a8.gemm(x, packed4), m, n, k):.0f}"
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def timed(run, reps: int, max_other: float) -> tuple[float, int, float]:
    """(best tokens/s over clean repetitions, discarded count, worst other-CPU share kept)."""
    best, discarded, worst = 0.0, 0, 0.0
    for _ in range(reps):
        with CpuMonitor() as mon:
            t0 = time.perf_counter()
            tokens = run()
            rate = getattr(run, "rate", None) or tokens / (time.perf_counter() - t0)
        if mon.sample.is_contaminated(max_other):
            discarded += 1
            continue
        best, worst = max(best, rate), max(worst, mon.sample.other_share)
    return best, discarded, worst


DTYPE = "auto"  # --dtype: what every LeanLM row runs (auto: bf16 where our bf16 kernels run, float32 at AVX2)


def leanlm_llm(model: str, batch: int, dequantize: bool, prefix_caching=False, **options) -> LLM:
    """The engine every LeanLM row runs: in DTYPE, capped at `batch` running requests."""
    return LLM(
        model,
        dtype=DTYPE,
        progress=False,
        max_num_seqs=batch,
        dequantize_gguf=dequantize,
        enable_prefix_caching=prefix_caching,
        **options,
    )


def leanlm_runner(
    model: str, batch: int, dequantize: bool, prompt_sets, output_len: int, prefix_caching=False, **options
):
    """prompt_sets: [prompts] (every repetition runs them; the warm-up the first `batch`), or [warm-up set,
    repetition 1's, ...] with prefix caching on (see Workload)."""
    llm = leanlm_llm(model, batch, dequantize, prefix_caching, **options)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    warmup = prompt_sets[0] if len(prompt_sets) > 1 else prompt_sets[0][:batch]
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm + pack
    reps = iter(prompt_sets[1:]) if len(prompt_sets) > 1 else None

    def run() -> int:
        prompts = next(reps) if reps is not None else prompt_sets[0]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def hf_runner(hf_dir: Path, batch: int, prompt_sets, output_len: int):
    """HF has no prefix cache: each repetition computes its prompts whole (the sets as leanlm_runner's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    runner = HFRunner(model, pad_id=0, batch_size=batch)
    reps = iter(prompt_sets[1:]) if len(prompt_sets) > 1 else None

    def run() -> int:
        prompts = next(reps) if reps is not None else prompt_sets[0]
        runner.throughput(prompts, output_len)
        return len(prompts) * output_len

    return run


def llama_cpp_runner(model: str, batch: int, output_len: int, prompt_len: int = 24, shared: bool = False):
    """llama-batched-bench, one configuration per call; None when it is not built. shared (-pps): one prompt,
    computed once, that every sequence continues from."""
    if not LLAMA_BATCHED_BENCH.is_file():
        return None
    command = [str(LLAMA_BATCHED_BENCH), "-m", str(resolve_model(model)), "-t", str(torch.get_num_threads())]
    command += ["-c", str(batch * (prompt_len + output_len) + 64), "-b", "2048", "-ub", "512"]
    command += ["-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(batch), "--output-format", "jsonl"]
    command += ["-pps"] if shared else []

    def run() -> int:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        run.rate = batch * output_len / (row["t_pp"] + row["t_tg"])  # timed by the tool, not by us
        return batch * output_len

    return run


def print_progress(name: str, line: str) -> None:
    """One worker event, short (a repetition's token ids are left out)."""
    event = json.loads(line)
    if event["event"] == "repetition":
        rate = sum(map(len, event["output_token_ids"])) / event["wall_s"]
        other = round(event["cpu"]["other_share"], 3)
        event = {k: event[k] for k in ("event", "max_num_seqs", "rep")} | {"tok/s": round(rate, 1), "other_cpu": other}
    print(f"{name}: {json.dumps(event)[:300]}", flush=True)


def checkpoint(kind: str, model: str = DEFAULT_MODEL) -> Path:
    """LeanLM's RTN checkpoint of the model ("int8": every linear and the head at int8 per channel; "int4": g64
    with the head at int8, as OpenVINO's int4 export keeps it), written once under PEERS_DIR."""
    return quantized_dir(str(resolve_model(model)), kind, PEERS_DIR / "leanlm-checkpoints")


def prompt_count(batch: int, num_prompts: int) -> int:
    """Prompts a batch cap runs: 4 at batch 1, else num_prompts, or `batch` where that is more (every cap filled)."""
    return 4 if batch == 1 else max(num_prompts, batch)


def prompt_sets(prompts: list[list[int]], batch: int, args) -> list[list[list[int]]]:
    """What the in-process runners take: [the cap's prompts], or with a shared prefix consecutive sets of them,
    the warm-up's first and then one per repetition (the layout a peer's distinct_reps request has)."""
    n = prompt_count(batch, args.num_prompts)
    if not WORKLOADS[args.workload].shared:
        return [prompts[:n]]
    return [prompts[i * n : (i + 1) * n] for i in range(args.reps + 1)]


def process_peer_rates(model: str, name: str, batches: list[int], prompts, args):
    """{batch: (best clean tok/s, discarded, worst other share kept)} of one process peer: a single worker run
    over every batch (the peer's engine capped at `batch` running requests, on the prompts prompt_sets gives)."""
    output_len, reps, max_other, num_prompts = args.output_len, args.reps, args.max_other_cpu, args.num_prompts
    spec, weights = PROCESS_PEERS[name]
    model_dir = ensure_openvino_ir(model, weights) if weights else ensure_dense_dir(model)
    counts = {b: prompt_count(b, num_prompts) for b in batches}
    shared = WORKLOADS[args.workload].shared
    request = PeerRequest(
        model_dir,
        tuple(map(tuple, prompts)),
        output_len,
        tuple(PeerBatch(b, counts[b]) for b in batches),
        reps,
        options={"prefix_caching": True} if shared else {},
        distinct_reps=shared,
    )
    run = run_peer(spec, request, on_line=lambda line: print_progress(name, line))
    out = {}
    for batch in batches:
        reps_ = [r for r in run.repetitions if r.max_num_seqs == batch]
        clean = [r for r in reps_ if not r.cpu.is_contaminated(max_other)]
        best = max((r.output_tokens_per_s for r in clean), default=0.0)
        out[batch] = (best, len(reps_) - len(clean), max((r.cpu.other_share for r in clean), default=0.0))
    return out, run.info


def selected_peers(flag: str) -> list[str]:
    """--peers: "auto" (those whose environment is set up), "none", or names from PROCESS_PEERS."""
    if flag == "auto":
        return list(PROCESS_PEERS)  # an absent environment becomes a "-" column and a note
    names = [n for n in flag.split(",") if n and n != "none"]
    unknown = sorted(set(names) - set(PROCESS_PEERS))
    if unknown:
        raise SystemExit(f"unknown --peers {unknown}; use auto, none or some of {', '.join(PROCESS_PEERS)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    ap.add_argument("--batches", default=None, help="batch caps (default: the workload's)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-batches", default="32", help="batch sizes to run HF at (it is slow)")
    ap.add_argument("--peers", default="auto", help=f"auto, none, or some of {','.join(PROCESS_PEERS)}")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="LeanLM's KV cache (int8: as OpenVINO's default u8 cache; auto: the model dtype)",
    )
    ap.add_argument("--engines", default=",".join(IN_PROCESS), help="in-process rows to run (default: all)")
    ap.add_argument("--linear-rows", default="8,16,32,64,128,256,512", help="'' skips the linear table")
    ap.add_argument("--max-other-cpu", type=float, default=0.10)
    ap.add_argument("--dtype", default="auto", help="LeanLM's activations: auto (bf16 on AVX512, float32 on AVX2)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    global DTYPE
    DTYPE = args.dtype
    peers = selected_peers(args.peers)
    wl = WORKLOADS[args.workload]
    engines = [e for e in args.engines.split(",") if e]
    if set(engines) - set(IN_PROCESS):
        raise SystemExit(f"unknown --engines {sorted(set(engines) - set(IN_PROCESS))}; use some of {IN_PROCESS}")

    batches = [int(b) for b in (args.batches or wl.batches).split(",")]
    lines = [f"Machine: {describe_machine()}.", ""]
    if args.linear_rows:
        lines += linear_table([int(r) for r in args.linear_rows.split(",")]) + [""]
    print("\n".join(lines), flush=True)

    sets = args.reps + 1 if wl.shared else 1
    prompts = wl.prompts(sets * max(prompt_count(b, args.num_prompts) for b in batches), seed=0)
    hf_batches = {int(b) for b in args.hf_batches.split(",") if b}
    rates: dict[tuple[str, int], float] = {}
    notes, peer_info = [], []
    for batch in batches:
        work = prompt_sets(prompts, batch, args)
        lean = lambda model, dequantize=False, **options: leanlm_runner(  # noqa: E731
            model, batch, dequantize, work, args.output_len, wl.shared, kv_cache_dtype=args.kv_cache_dtype, **options
        )
        for name, make in (
            ("codes", lambda: lean(args.model, act_quant="none")),
            ("codes-a8", lambda: lean(args.model, act_quant="int8")),
            ("bf16", lambda: lean(args.model, True)),
            ("int8", lambda: lean(str(checkpoint("int8", args.model)), act_quant="none")),
            ("int8-a8", lambda: lean(str(checkpoint("int8", args.model)), act_quant="int8")),
            ("w8a8", lambda: lean(str(checkpoint("w8a8", args.model)))),
            ("int4", lambda: lean(str(checkpoint("int4", args.model)), act_quant="none")),
            ("int4-a8", lambda: lean(str(checkpoint("int4", args.model)), act_quant="int8")),
            ("hf", lambda: hf_runner(ensure_dense_dir(args.model), batch, work, args.output_len)),
            ("llama.cpp", lambda: llama_cpp_runner(args.model, batch, args.output_len, wl.llama_cpp_prompt, wl.shared)),
        ):
            if (name == "hf" and batch not in hf_batches) or name not in engines:
                continue
            run = make()
            if run is None:
                continue
            rate, dropped, worst = timed(run, args.reps, args.max_other_cpu)
            rates[(name, batch)] = rate
            notes.append(f"batch {batch} {name}: {dropped} repetition(s) discarded, other CPU <= {worst:.1%}")
            print(f"batch {batch} {name}: {rate:.1f} tok/s ({notes[-1]})", flush=True)
            del run
    for name in peers:
        spec = PROCESS_PEERS[name][0]
        if not spec.is_installed():
            peer_info.append(f"{HEADERS[name]}: -, {spec.missing_message()}")
            continue
        results, info = process_peer_rates(args.model, name, batches, prompts, args)
        peer_info.append(f"{HEADERS[name]}: {json.dumps(info, sort_keys=True)}")
        for batch, (rate, dropped, worst) in results.items():
            rates[(name, batch)] = rate
            notes.append(f"batch {batch} {name}: {dropped} repetition(s) discarded, other CPU <= {worst:.1%}")
    lines += throughput_table(rates, batches, [*engines, *peers], args)
    if peer_info:
        lines += ["", "Peers in environments of their own (what each worker reported):", ""]
        lines += [f"- {line}" for line in peer_info]
    lines += ["", "Repetitions: " + "; ".join(notes) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        command = f"python benchmarks/batched_decode.py --workload {args.workload}"
        command += "" if args.model == DEFAULT_MODEL else f" --model {Path(args.model).name}"
        command += "" if args.kv_cache_dtype == "auto" else f" --kv-cache-dtype {args.kv_cache_dtype}"
        args.out.write_text(f"# Batched decode, {args.workload} workload (`{command}`)\n\n{text}")


def throughput_table(rates: dict[tuple[str, int], float], batches: list[int], columns: list[str], args) -> list[str]:
    """A column per engine ("-" where it did not run, or all its repetitions were discarded) and the ratios."""
    ratios = [(a, b) for a, b in RATIOS if b in columns]
    wl = WORKLOADS[args.workload]
    llama = f"llama.cpp: {wl.llama_cpp_prompt}-token prompts" + (", one shared (-pps)" if wl.shared else "")
    lines = [
        f"Offline throughput, output tokens/s (best of {args.reps} clean repetitions; {args.num_prompts} prompts of "
        f"{wl.describe()} x {args.output_len} greedy tokens, or as many as the batch cap where that is more; batch 1 "
        f"runs 4 prompts; {llama}; LeanLM's KV cache: {args.kv_cache_dtype}):",
        "",
        "| batch | "
        + " | ".join(HEADERS[c] for c in columns)
        + " | "
        + " | ".join(f"{a} / {SHORT.get(b, b)}" for a, b in ratios)
        + " |",
        "|---:|" + "---:|" * (len(columns) + len(ratios)),
    ]
    for batch in batches:
        got = {c: rates[(c, batch)] for c in columns if rates.get((c, batch))}
        cells = [f"{got[c]:.1f}" if c in got else "-" for c in columns]
        cells += [f"{got[a] / got[b]:.2f}x" if a in got and b in got else "-" for a, b in ratios]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
