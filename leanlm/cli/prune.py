"""`leanlm prune`: magnitude, Wanda or SparseGPT pruning (unstructured or N:M), optionally followed by a
quantizer (or SparseGPT's joint prune + quantize), or TEAL activation sparsity (thresholds on each linear's
inputs, whose zeroed entries' weight rows decode skips), saved as a checkpoint the engine loads."""

from __future__ import annotations

import argparse

from leanlm.compress.activation.act_sparsity import ALLOCATIONS
from leanlm.compress.named_recipes import PRUNE_METHODS as METHODS
from leanlm.compress.named_recipes import build_prune_recipe
from leanlm.compress.prune.magnitude import SCOPES
from leanlm.compress.prune.owl import PROFILES


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
    from leanlm.cli.quantize import run_job

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
    return run_job(args, recipe, args.format)
