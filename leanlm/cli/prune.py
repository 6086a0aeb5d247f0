"""`leanlm prune`: magnitude, Wanda or SparseGPT pruning (unstructured or N:M), optionally followed by a
quantizer (or SparseGPT's joint prune + quantize), or TEAL activation sparsity (thresholds on each linear's
inputs, whose zeroed entries' weight rows decode skips), saved as a checkpoint the engine loads."""

from __future__ import annotations

import argparse

from leanlm.compress.activation.act_sparsity import ALLOCATIONS, ActivationSparsityConfig
from leanlm.compress.base import MethodConfig
from leanlm.compress.prune.magnitude import SCOPES, MagnitudeConfig
from leanlm.compress.prune.owl import PROFILES
from leanlm.compress.prune.permute import PermuteConfig
from leanlm.compress.prune.sparsegpt import SparseGPTConfig
from leanlm.compress.prune.wanda import WandaConfig

METHODS = ("magnitude", "wanda", "sparsegpt", "teal")


def build_prune_recipe(
    method: str,
    sparsity: float | None = None,
    pattern: str | None = None,
    scope: str = "layer",
    then_quantize: str | None = None,
    bits: int | None = None,
    group_size: int | None = None,
    joint: bool = False,
    permute: bool = False,
    allocation: str | None = None,
    profile: str = "uniform",
    owl_lambda: float | None = None,
) -> list[MethodConfig]:
    """The recipe behind `leanlm prune`; validates every option before anything loads."""
    if owl_lambda is not None and profile != "owl":
        raise ValueError("--owl-lambda sets how far OWL moves each layer's sparsity: add --profile owl")
    if profile != "uniform" and method == "teal":
        raise ValueError("--profile spreads weight sparsity over layers; teal takes --allocation instead")
    if allocation is not None and method != "teal":
        raise ValueError(f"--allocation spreads teal's activation sparsity over a layer; {method} does not take it")
    if method == "teal":
        given = {"--pattern": pattern, "--then-quantize": then_quantize, "--bits": bits, "--group-size": group_size}
        given.update({"--joint": joint or None, "--permute": permute or None})
        if scope != "layer" or any(v is not None for v in given.values()):
            flags = [k for k, v in given.items() if v is not None] + (["--scope"] if scope != "layer" else [])
            raise ValueError(
                f"teal zeroes a fraction of each linear's inputs (--sparsity); {', '.join(flags)} do not apply"
            )
        return [
            ActivationSparsityConfig(sparsity=0.4 if sparsity is None else sparsity, allocation=allocation or "uniform")
        ]
    if permute:
        if pattern is None:
            raise ValueError("--permute reorders channels for an N:M pattern: add --pattern, e.g. 2:4")
        # the order is searched on the score the pruner ranks by (Wanda's stands in for SparseGPT's saliency)
        score = "magnitude" if method == "magnitude" else "wanda"
        rest = build_prune_recipe(
            method, sparsity, pattern, scope, then_quantize, bits, group_size, joint, profile=profile
        )
        return [PermuteConfig(pattern=pattern, score=score), *rest]
    from leanlm.cli.quantize import build_recipe

    target = dict(sparsity=sparsity, pattern=pattern, profile=profile)
    if owl_lambda is not None:
        target["owl_lambda"] = owl_lambda
    if joint:
        if method != "sparsegpt":
            raise ValueError("--joint is SparseGPT's prune + quantize in one sweep: use it with --method sparsegpt")
        if then_quantize is not None:
            raise ValueError("--joint quantizes inside SparseGPT's sweep; drop --then-quantize")
        group = 64 if group_size is None else (group_size or None)
        return [SparseGPTConfig(**target, bits=bits or 4, group_size=group)]
    if method == "magnitude":
        prune = MagnitudeConfig(**target, scope=scope)
    elif method == "wanda":
        prune = WandaConfig(**target)
    elif method == "sparsegpt":
        prune = SparseGPTConfig(**target)
    else:
        raise ValueError(f"unknown pruning method {method!r}; use one of {', '.join(METHODS)}")
    if scope != "layer" and method != "magnitude":
        raise ValueError(f"--scope applies to magnitude pruning; {method} compares weights within each row")
    if then_quantize is None:
        if bits is not None or group_size is not None:
            raise ValueError("--bits/--group-size need --then-quantize METHOD (or --joint with sparsegpt)")
        return [prune]
    return [prune, *build_recipe(then_quantize, bits, group_size)]


def add_parser(sub) -> None:
    from leanlm.cli.quantize import METHODS as QUANT_METHODS
    from leanlm.cli.quantize import add_calibration_args, add_output_args
    from leanlm.loading.registry import DEFAULT_MODEL

    p = sub.add_parser("prune", help="prune a model (magnitude, Wanda, SparseGPT; unstructured or N:M) and save it")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, GGUF file or HF directory")
    p.add_argument("--method", choices=METHODS, required=True, help="pruning method (docs/sparsity.md)")
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="fraction of weights to zero (default 0.5); teal: of each linear's inputs (default 0.4)",
    )
    target.add_argument("--pattern", default=None, help="N:M sparsity, e.g. 2:4 (keep 2 of every 4 inputs)")
    p.add_argument("--scope", choices=SCOPES, default="layer", help="magnitude: where the fraction holds")
    p.add_argument(
        "--permute",
        action="store_true",
        help="N:M: first reorder input channels (folded into the producing layers) to keep more weight",
    )
    p.add_argument(
        "--then-quantize", choices=QUANT_METHODS, default=None, help="quantize the pruned model (zeros stay zero)"
    )
    p.add_argument("--joint", action="store_true", help="sparsegpt: prune and quantize in one sweep (--bits)")
    p.add_argument(
        "--allocation",
        choices=ALLOCATIONS,
        default=None,
        help="teal: the same share for every linear (uniform, the default), or spread over a layer's linears by "
        "their own output error (greedy) or the layer's (block: TEAL's)",
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="uniform",
        help="unstructured --sparsity: the same in every layer, or OWL's (layers with more outlier weights "
        "pruned less; the model's sparsity unchanged)",
    )
    p.add_argument(
        "--owl-lambda", type=float, default=None, help="OWL: the layer sparsities span 2 x this (default 0.08)"
    )
    p.add_argument("--bits", type=int, default=None, help="weight bits of the quantization step (default 4)")
    p.add_argument("--group-size", type=int, default=None, help="columns per scale (default 64); 0 = per channel")
    add_calibration_args(p, "Wanda, SparseGPT")
    p.add_argument(
        "--format",
        choices=("leanlm", "compressed-tensors"),
        default="leanlm",
        help="checkpoint layout: leanlm's, or compressed-tensors' sparse-24-bitmask / sparse-bitmask (llm-compressor)",
    )
    add_output_args(p)
    p.set_defaults(func=cmd_prune)


def cmd_prune(args: argparse.Namespace) -> int:
    from leanlm.cli.quantize import run_recipe
    from leanlm.compress.base import build_method

    recipe = build_prune_recipe(
        args.method,
        args.sparsity,
        args.pattern,
        args.scope,
        args.then_quantize,
        args.bits,
        args.group_size,
        args.joint,
        args.permute,
        args.allocation,
        args.profile,
        args.owl_lambda,
    )
    if args.format == "compressed-tensors" and (args.method == "teal" or args.then_quantize or args.joint):
        raise ValueError("--format compressed-tensors writes pruned float weights: drop --then-quantize/--joint")
    needs_calibration = any(build_method(cfg).needs for cfg in recipe)
    return run_recipe(args, recipe, needs_calibration, args.format)
