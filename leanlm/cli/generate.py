"""`leanlm generate`: complete prompts (batched), or pick among samples (best-of-N, majority vote)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from leanlm.cli.common import (
    add_model_args,
    add_sampling_args,
    load_llm,
    sampling_params,
)
from leanlm.kernels.build import compile_seconds


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


def _lora_flag(args: argparse.Namespace):
    """--lora PATH as the LoRARequest every prompt runs with (its file checked before the model loads, the engine's
    LoRA slots sized to it), or None."""
    if args.lora is None:
        return None
    from pathlib import Path

    from leanlm.formats.peft import read_adapter
    from leanlm.lora_request import LoRARequest

    adapter = read_adapter(args.lora)
    args.enable_lora = True
    args.max_lora_rank = max(args.max_lora_rank, adapter.max_rank)
    return LoRARequest(Path(args.lora).resolve().name or "adapter", args.lora, args.lora_scale)


def _generate_selected(args: argparse.Namespace, llm, prompts: list[str], selection, lora=None) -> int:
    """--best-of: the best sample and its mean token logprob; --majority-vote: the winning answer and its support."""
    from leanlm.selection import best_of, majority_vote

    kind, params, extract = selection
    if args.chat:
        messages = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(messages, params, use_tqdm=len(prompts) > 1, lora_request=lora)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1, lora_request=lora)
    for prompt, out in zip(prompts, outputs):
        if kind == "best_of":
            ranking = best_of(out.outputs)
            best = ranking.best
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": best.text,
                            "token_ids": best.token_ids,
                            "finish_reason": best.finish_reason,
                            "mean_logprob": ranking.score,
                            "num_samples": len(out.outputs),
                        }
                    )
                )
            else:
                print(f"{prompt}{best.text}" if not args.chat else best.text)
                print(f"[best of {len(out.outputs)} samples: mean token logprob {ranking.score:.4f}]")
                print()
            continue
        vote = majority_vote(out.outputs, extract)
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "answer": vote.answer,
                        "support": vote.support,
                        "votes": vote.votes,
                        "num_voting": vote.num_voting,
                        "num_samples": vote.num_samples,
                        "counts": [[a, n] for a, n in vote.counts],
                    },
                    default=str,
                )
            )
        else:
            counts = ", ".join(f"{a!r}: {n}" for a, n in vote.counts) or "none"
            answer = "no sample gave an answer" if vote.answer is None else repr(vote.answer)
            print(
                f"{prompt}\nanswer: {answer} (support {vote.support:.2f}: {vote.votes} of {vote.num_voting} "
                f"answering samples, {vote.num_samples} sampled; votes {counts})"
            )
            print()
    return 0


def _structured_outputs(args: argparse.Namespace):
    """--json-schema FILE / --regex REGEX / --grammar FILE as StructuredOutputsParams (None when none is given)."""
    from leanlm.structured_outputs import StructuredOutputsParams

    given = [name for name in ("json_schema", "regex", "grammar") if getattr(args, name) is not None]
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --regex and --grammar")
    if not given:
        return None
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    path = Path(args.json_schema if args.json_schema is not None else args.grammar)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if args.json_schema is not None:
        return StructuredOutputsParams(json=text)
    return StructuredOutputsParams(grammar=text)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate flags before the (slow) model load
    structured = _structured_outputs(args)
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured)
    selection = _selection_flags(args, params)
    lora = _lora_flag(args)
    llm = load_llm(args)
    prompts = list(args.prompts)
    if selection is not None:
        return _generate_selected(args, llm, prompts, selection, lora)
    start, compiled_before = time.perf_counter(), compile_seconds()
    if args.chat:
        messages = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(messages, params, use_tqdm=len(prompts) > 1, lora_request=lora)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1, lora_request=lora)
    elapsed = time.perf_counter() - start
    compiled = compile_seconds() - compiled_before
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                    }
                )
            )
        else:
            print(f"{prompt}{completion.text}" if not args.chat else completion.text)
            print()
    print(f"[{timing_line(outputs, elapsed, compiled)}; {llm.model_config.name or args.model}, "
          f"{str(llm.dtype).removeprefix('torch.')}]", file=sys.stderr)  # fmt: skip
    if activity := activity_line(llm.llm_engine.stats()):
        print(f"[{activity}]", file=sys.stderr)
    return 0


def activity_line(stats) -> str | None:
    """What the engine had to do beyond computing (preemptions, swaps, MoE capacity drops), or None."""
    sched, parts = stats.scheduler, []
    if sched.num_preemptions:
        parts.append(f"{sched.num_preemptions} preemption(s) by recompute (KV blocks ran out)")
    if sched.num_swaps_out:
        parts.append(f"{sched.num_swaps_out} swap(s) out to host memory, {sched.num_swaps_in} back in")
    if stats.moe is not None and stats.moe.dropped:
        moe = stats.moe
        parts.append(
            f"MoE: {moe.dropped} of {moe.assignments} expert assignments dropped by capacity ({moe.drop_rate:.1%})"
        )
    return "engine: " + "; ".join(parts) if parts else None


def timing_line(outputs, elapsed: float, compiled: float) -> str:
    """`N tokens in S s (prefill, decode rate, one-time kernel compilation)`: the decode rate from the requests'
    own timestamps, so neither the prompt nor the first run's kernel compilation counts as generation time."""
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    metrics = [o.metrics for o in outputs if o.metrics is not None and o.metrics.first_token_time is not None]
    parts = []
    if metrics:
        first_token = max(m.first_token_time for m in metrics)
        parts.append(f"prefill {first_token - min(m.first_scheduled_time for m in metrics):.2f} s")
        decoded = num_generated - sum(len(o.outputs) for o in outputs)  # each completion's first token is prefill's
        decode_s = max(m.finished_time for m in metrics) - first_token
        if decoded > 0 and decode_s > 0:
            parts.append(f"decode {decoded / decode_s:.1f} tokens/s")
    if compiled >= 0.01:
        parts.append(f"{compiled:.2f} s of it compiling kernels, once per machine")
    return f"{num_generated} tokens in {elapsed:.2f} s" + (f" ({'; '.join(parts)})" if parts else "")


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="complete prompts (batched)")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text; several are batched together")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.add_argument(
        "--best-of",
        type=int,
        default=None,
        metavar="N",
        help="sample N completions per prompt (set --temperature > 0); print the one with the highest "
        "mean token logprob, with that score",
    )
    gen.add_argument(
        "--majority-vote",
        type=int,
        default=None,
        metavar="K",
        help="self-consistency: sample K completions per prompt (set --temperature > 0), extract each "
        "one's answer with --answer-regex, print the most frequent answer and its support",
    )
    gen.add_argument(
        "--answer-regex",
        default=None,
        metavar="REGEX",
        help="answer of a sample for --majority-vote: the first group of the first match (or the whole "
        "match); samples without a match do not vote",
    )
    gen.add_argument(
        "--lora",
        default=None,
        metavar="PATH",
        help="run every prompt with this LoRA adapter (the directory PEFT's save_pretrained or `leanlm train "
        "--lora` wrote)",
    )
    gen.add_argument(
        "--lora-scale", type=float, default=1.0, metavar="S", help="with --lora: scale the adapter's product by S"
    )
    gen.add_argument("--json-schema", default=None, metavar="FILE", help="the output is JSON following this schema")
    gen.add_argument("--regex", default=None, metavar="REGEX", help="the output matches this regex (whole)")
    gen.add_argument(
        "--grammar", default=None, metavar="FILE", help="the output follows this Lark (llguidance) or GBNF grammar"
    )
    add_model_args(gen)
    add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
