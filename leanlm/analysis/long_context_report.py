"""The long-context part of `leanlm estimate`'s report: KV bytes per sequence and attention FLOPs at 4k-128k
tokens, full attention beside a window with sinks and a KV budget. The numbers come from estimate_long_context;
this module only arranges and prints them."""

from __future__ import annotations

from dataclasses import asdict

from leanlm.analysis import estimate as est
from leanlm.analysis.estimate_long_context import BoundedAttention, long_context_rows, long_contexts
from leanlm.analysis.model_shape import ModelShape
from leanlm.analysis.text_table import si as si_units
from leanlm.analysis.text_table import table as _table


def long_context_report(shape: ModelShape, kv: est.NumberFormat, bound: BoundedAttention) -> dict:
    return {
        **asdict(bound),
        "model_context": shape.max_context,
        "kv_bytes_per_token": est.kv_bytes_per_token(shape, kv),
        "matmul_flops_per_token": est.matmul_flops_per_token(shape),
        "rows": [asdict(row) for row in long_context_rows(shape, kv, bound, long_contexts(shape.max_context))],
    }


def long_context_lines(lc: dict) -> list[str]:
    window = f"window {lc['window']}+{lc['sinks']}" if lc["window"] is not None else None
    budget = f"budget {lc['kv_budget']}" if lc["kv_budget"] is not None else None
    kinds = [("full", "full"), *([("window", window)] if window else []), *([("budget", budget)] if budget else [])]

    def label(n: int) -> str:
        return f"{n:,}{'*' if n == lc['model_context'] else ''}"

    kv_rows = [[label(r["context"]), *(si_units(r[k]["kv_bytes"], "B") for k, _ in kinds)] for r in lc["rows"]]
    prefill_kinds = [k for k in kinds if k[0] != "budget"]  # a budget's prefill is the full one
    flop_rows = [
        [label(r["context"])]
        + [si_units(r[k]["decode_flops"]) for k, _ in kinds]
        + [si_units(r[k]["prefill_flops"]) for k, _ in prefill_kinds]
        for r in lc["rows"]
    ]
    flop_header = ["attention FLOPs", *(f"decode {name}" for _, name in kinds)]
    flop_header += [f"prefill {name}" for _, name in prefill_kinds]
    own = f"*: the model's own context ({lc['model_context']:,})" if lc["model_context"] else ""
    lines = [
        f"long context  KV {si_units(lc['kv_bytes_per_token'], 'B')} per token; the weights' matmuls: "
        f"{si_units(lc['matmul_flops_per_token'], 'FLOP')} per token at any context",
        *([f"              {own}"] if own else []),
        "",
        _table(["KV cache per sequence", *(name for _, name in kinds)], kv_rows),
        "",
        _table(flop_header, flop_rows),
        "          decode: one token at that context; prefill: a whole prompt of that length",
    ]
    if budget:
        lines.append("          a KV budget leaves prefill as it is: the prompt is attended in full before eviction")
    return lines
