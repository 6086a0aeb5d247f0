"""The recipes behind the method names of `leanlm quantize` and `leanlm prune`: a name and its options in, the
list of MethodConfigs compress() runs out, every option checked before anything loads."""

from __future__ import annotations

from leanlm.compress.activation.act_sparsity import ActivationSparsityConfig
from leanlm.compress.base import MethodConfig
from leanlm.compress.prune.magnitude import MagnitudeConfig
from leanlm.compress.prune.permute import PermuteConfig
from leanlm.compress.prune.sparsegpt import SparseGPTConfig
from leanlm.compress.prune.wanda import WandaConfig
from leanlm.compress.quantize.fp8 import FP8Config
from leanlm.compress.quantize.gptq import GPTQConfig
from leanlm.compress.quantize.llm_int8 import LLMInt8Config
from leanlm.compress.quantize.rtn import RTNConfig
from leanlm.compress.transform.awq import AWQConfig
from leanlm.compress.transform.smoothquant import SmoothQuantConfig

PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt", "teal")
QUANTIZE_METHODS = ("rtn", "gptq", "awq", "smoothquant", "llm_int8", "fp8", "zeroquant")


def build_recipe(
    method: str,
    bits: int | None = None,
    group_size: int | None = None,
    act_bits: int | None = None,
    alpha: float = 0.5,
    threshold: float = 6.0,
    act_order: bool = True,
    symmetric: bool | None = None,
    quantize_lm_head: bool = False,
    true_sequential: bool = False,
    static_groups: bool = False,
) -> list[MethodConfig]:
    """The recipe behind each CLI method. group_size None = the method's default (64 below 8 bits, per
    channel at 8), 0 = per channel."""
    ignore = () if quantize_lm_head else ("lm_head",)
    if method in ("smoothquant", "zeroquant"):
        bits = bits or 8
    bits = bits or (8 if method in ("llm_int8", "fp8") else 4)
    if group_size is None:
        group_size = None if bits == 8 and method != "zeroquant" else 64
    elif group_size == 0:
        group_size = None
    scheme = dict(bits=bits, group_size=group_size, symmetric=symmetric, act_bits=act_bits, ignore=ignore)
    if method == "rtn":
        return [RTNConfig(**scheme)]
    if method == "gptq":
        return [GPTQConfig(**scheme, act_order=act_order, true_sequential=true_sequential, static_groups=static_groups)]
    if method == "awq":
        return [AWQConfig(**scheme), RTNConfig(**scheme)]
    if method == "smoothquant":
        return [SmoothQuantConfig(alpha=alpha, ignore=ignore), RTNConfig(**{**scheme, "act_bits": 8})]
    if method == "zeroquant":
        return [RTNConfig(**{**scheme, "act_bits": 8})]
    if method == "llm_int8":
        return [LLMInt8Config(threshold=threshold, ignore=ignore)]
    if method == "fp8":
        return [FP8Config(ignore=ignore)]
    raise ValueError(f"unknown method {method!r}; use one of {', '.join(QUANTIZE_METHODS)}")


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
        raise ValueError(f"unknown pruning method {method!r}; use one of {', '.join(PRUNE_METHODS)}")
    if scope != "layer" and method != "magnitude":
        raise ValueError(f"--scope applies to magnitude pruning; {method} compares weights within each row")
    if then_quantize is None:
        if bits is not None or group_size is not None:
            raise ValueError("--bits/--group-size need --then-quantize METHOD (or --joint with sparsegpt)")
        return [prune]
    return [prune, *build_recipe(then_quantize, bits, group_size)]
