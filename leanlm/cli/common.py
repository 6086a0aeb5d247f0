"""Shared by the commands: flags generated from config dataclass fields, model and sampling flags."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from leanlm.config import DecodingOptions, EngineConfig
from leanlm.config.engine import option_names
from leanlm.config.long_context import LongContextConfig


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
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
        flags = ("--" + field.name.replace("_", "-"), *field.metadata.get("flags", ()))
        # A missing help is caught by tests/test_cli_help.py, not here: the CLI must not fail over a help line.
        options = {"default": field.default, "help": field.metadata.get("help")}
        if base is bool:
            action = group.add_argument(*flags, action=argparse.BooleanOptionalAction, **options)
        elif "choices" in field.metadata:  # a closed set of names: argparse lists them in --help and errors
            action = group.add_argument(*flags, type=base, choices=field.metadata["choices"], **options)
        else:  # a field's own `parse` (e.g. byte counts with units) reads the flag's text where it has one
            parse = field.metadata.get("parse", base)
            action = group.add_argument(*flags, type=parse, metavar=base.__name__.upper(), **options)
        # BooleanOptionalAction appends the default itself on some Python versions: never twice.
        if action.help and field.default not in (None, "") and "%(default)" not in action.help:
            action.help += " (default: %(default)s)"


def engine_options(args: argparse.Namespace) -> dict:
    """The engine flags as EngineConfig.from_options (and LLM) take them."""
    return {name: getattr(args, name) for name in sorted(option_names())}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    from leanlm.loading.registry import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    parser.add_argument(
        "--dequantize-gguf",
        action="store_true",
        help="run a GGUF file's Q4_0/Q4_1/Q4_K linears on float weights dequantized at load, not on their codes",
    )
    add_engine_args(parser)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine flag (EngineConfig, DecodingOptions, LongContextConfig): what `engine_options` reads back."""
    # EngineConfig's typed speculative / early_exit are spelled by DecodingOptions' flags of the same names
    typed = tuple(f.name for f in dataclasses.fields(DecodingOptions)) + ("long_context",)
    add_dataclass_args(parser, EngineConfig, exclude=typed)
    add_dataclass_args(parser, DecodingOptions)
    add_dataclass_args(parser, LongContextConfig)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help="most tokens to generate per completion (default: %(default)s)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off)",
    )
    parser.add_argument("--top-k", type=int, default=None, help="keep only the K most likely tokens (default: all)")
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens less likely than P times the most likely one (0 = off)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logits of tokens already in the prompt or output by this (1 = off)",
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible samples")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past end-of-sequence tokens, to exactly --max-tokens (benchmarks, long outputs)",
    )


def sampling_params(args: argparse.Namespace):
    from leanlm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def load_llm(args: argparse.Namespace):
    """The LLM of the model and engine flags; its layout (threads, KV pool, offloading, parallelism) goes to stderr."""
    import logging

    from leanlm.llm import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        dequantize_gguf=getattr(args, "dequantize_gguf", False),
        **engine_options(args),
    )
    logging.getLogger("leanlm.layout").info(llm.llm_engine.layout().describe())
    return llm
