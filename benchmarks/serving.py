"""Serving benchmark: the same streamed load against `leanlm serve` and llama.cpp's llama-server, in one run.

Both get the same prompts (non-overlapping WikiText-2 pieces), the same arrivals (seeded Poisson, or all at
once), greedy decoding and `output_len` tokens per request (EOS suppressed through logit_bias). Start
`leanlm serve` yourself and pass its URL; the llama.cpp peer is launched here on the same GGUF with
`--parallel` slots (see leanlm/analysis/peers.py for how its binary is built). A side that cannot run is
reported as unavailable, with the reason, instead of silently missing from the table.

    python benchmarks/serving.py --ours-url http://127.0.0.1:8000 --num-requests 32 --input-len 128 \\
        --output-len 64 --parallel 8 --out docs/serving.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from leanlm.analysis.load_generator import LoadConfig, prompts_from_file, run_load_sync
from leanlm.analysis.load_report import LoadResult, format_table
from leanlm.analysis.machine import describe_machine
from leanlm.analysis.peers import LlamaServer, LlamaServerConfig, PeerUnavailable
from leanlm.loading.checkpoint import load_tokenizer
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model

WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared/data/wikitext-2-raw/wiki.test.raw"


def measure(url: str, args: argparse.Namespace, eos_token_ids: tuple[int, ...], prompts: list[str],
            warmup_prompts: list[str]) -> LoadResult:
    """A short warm-up on prompts of its own (nothing for a prefix cache to reuse), then the measured run."""
    common = dict(url=url, output_len=args.output_len, eos_token_ids=eos_token_ids, seed=args.seed)
    if warmup_prompts:
        run_load_sync(LoadConfig(**common, num_requests=len(warmup_prompts)), warmup_prompts, progress=False)
    config = LoadConfig(**common, num_requests=args.num_requests, request_rate=args.request_rate,
                        max_concurrency=args.max_concurrency)
    return run_load_sync(config, prompts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ours-url", default=None, help="a running `leanlm serve` (omitted: not measured)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled name or GGUF path; llama.cpp loads it")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=math.inf)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent (and discarded) before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=8, help="llama.cpp slots")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all CPUs)")
    parser.add_argument("--port", type=int, default=8081, help="llama.cpp port")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--json", default=None, help="write every request of every run here")
    args = parser.parse_args()

    gguf = resolve_model(args.model)
    tokenizer = load_tokenizer(gguf)
    all_prompts = prompts_from_file(WIKITEXT, tokenizer, args.num_requests + args.warmup, args.input_len)
    prompts, warmup_prompts = all_prompts[:args.num_requests], all_prompts[args.num_requests:]
    results: dict[str, LoadResult] = {}
    unavailable: dict[str, str] = {}
    if args.ours_url:
        try:
            results["LeanLM"] = measure(args.ours_url, args, tokenizer.eos_token_ids, prompts, warmup_prompts)
        except ConnectionError as exc:
            unavailable["LeanLM"] = str(exc)
    else:
        unavailable["LeanLM"] = "no --ours-url given (start `leanlm serve` and pass its URL)"
    ctx_per_slot = args.input_len + args.output_len + 64  # room for a BOS and prompts that re-tokenize longer
    peer = LlamaServerConfig(gguf, parallel=args.parallel, ctx_per_slot=ctx_per_slot, port=args.port,
                             **({"threads": args.threads} if args.threads else {}))
    peer_name, peer_command = f"llama.cpp server, {args.parallel} slots", None
    try:
        with LlamaServer(peer) as server:
            peer_command = " ".join(server.command)
            results[peer_name] = measure(server.url, args, tokenizer.eos_token_ids, prompts, warmup_prompts)
    except PeerUnavailable as exc:
        unavailable[peer_name] = str(exc)

    report = render(args, gguf, results, unavailable, peer_command)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({n: r.to_dict() for n, r in results.items()}, indent=1))
    return 0 if results else 1


def render(args, gguf: Path, results: dict[str, LoadResult], unavailable: dict[str, str],
           peer_command: str | None) -> str:
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson, {args.request_rate} requests/s"
    lines = [
        "# Serving benchmark: LeanLM vs llama.cpp server", "",
        f"Machine: {describe_machine()}. Model: `{gguf.name}`. Load: {args.num_requests} requests ({rate}, seed "
        f"{args.seed}, max concurrency {args.max_concurrency or 'unlimited'}), prompts of about {args.input_len} "
        f"tokens cut from WikiText-2, {args.output_len} output tokens each (greedy, EOS suppressed by logit_bias), "
        f"streamed; {args.warmup} warm-up requests first. Command: `python benchmarks/serving.py "
        f"{' '.join(sys.argv[1:])}`.", "",
    ]
    if peer_command:
        lines += [f"llama.cpp: `{peer_command}`", ""]
    if results:
        lines += [format_table(results), ""]
    lines += [f"**{name}: unavailable.** {reason}" for name, reason in unavailable.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
