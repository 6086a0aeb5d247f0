"""The MoE part of `leanlm estimate`'s report: active against total bytes, decode bytes per step against the batch
(the batch at which every expert is read), and with expert parallelism, the all-to-all flat and hierarchical. The
numbers come from estimate_moe and all_to_all; this module only arranges and prints them."""

from __future__ import annotations

from dataclasses import asdict

from leanlm.analysis import estimate as est
from leanlm.analysis.all_to_all import ExpertParallelLayout, expert_parallel_cost
from leanlm.analysis.estimate_moe import moe_summary
from leanlm.analysis.model_shape import ModelShape
from leanlm.analysis.text_table import si as si_units
from leanlm.analysis.text_table import table as _table


def moe_report(
    shape: ModelShape, weights: est.NumberFormat, batch: int, coverage: float, layout: ExpertParallelLayout | None,
    act_bytes: int,
) -> dict:  # fmt: skip
    summary = moe_summary(shape, weights, batch, coverage)
    report = {**asdict(summary), "steps": [asdict(row) for row in summary.steps]}
    if layout is not None:
        report["expert_parallel"] = {
            **asdict(layout),
            "ranks_per_node": layout.ranks_per_node,
            "by_batch": [asdict(expert_parallel_cost(shape, layout, b, act_bytes)) for b in sorted({1, 64, batch})],
        }
    return report


def moe_lines(m: dict, num_experts: int) -> list[str]:
    lines = [
        f"MoE       {m['active_params']:,} of {m['total_params']:,} parameters active per token; batch-1 decode reads "
        f"{si_units(m['active_bytes_per_token'], 'B')} of {si_units(m['total_weight_bytes'], 'B')} of weights",
        f"          every expert is read ({m['coverage']:.0%} of {num_experts} per layer, uniform top-k routing) from "
        f"batch {m['all_experts_batch']}",
        "",
        _table(
            ["decode weights by batch", "experts/layer", "bytes/step", "bytes/token"],
            [
                [
                    f"b={r['batch']}",
                    f"{r['experts_per_layer']:.2f}",
                    si_units(r["weight_bytes"], "B"),
                    si_units(r["bytes_per_token"], "B"),
                ]
                for r in m["steps"]
            ],
        ),  # fmt: skip
    ]
    if "expert_parallel" in m:
        lines += ["", *_expert_parallel_lines(m["expert_parallel"])]
    return lines


def _expert_parallel_lines(ep: dict) -> list[str]:
    p, g, n = ep["expert_parallel_size"], ep["nodes"], ep["ranks_per_node"]
    rows = []
    for c in ep["by_batch"]:
        rows.append([
            f"b={c['num_tokens']}", si_units(c["dispatch_bytes_per_rank"], "B"),
            f"{c['flat_messages_per_rank']} ({c['flat_inter_node_messages_per_rank']} inter)",
            f"{c['hierarchical_messages_per_rank']} ({c['hierarchical_inter_node_messages_per_rank']} inter)",
            f"{c['flat_step_s'] * 1e3:.3g}", f"{c['hierarchical_step_s'] * 1e3:.3g}",
        ])  # fmt: skip
    header = f"EP={p} on {g} node(s) x {n}, {ep['by_batch'][0]['experts_per_rank']:g} expert(s) per rank"
    return [
        _table([header, "dispatch B/rank", "flat msgs", "hier. msgs", "flat ms", "hier. ms"], rows),
        "          per MoE layer and direction; ms: dispatch + combine of every MoE layer of a decode step",
    ]
