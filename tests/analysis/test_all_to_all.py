"""Expert parallelism's all-to-all: bytes and messages per rank, flat against hierarchical, checked against a
simulation that routes every token copy through both algorithms."""

from __future__ import annotations

import json
import random

import pytest

from leanlm.analysis.all_to_all import (
    ExpertParallelLayout,
    expert_parallel_cost,
    flat_all_to_all,
    hierarchical_all_to_all,
    rank_payload_bytes,
)
from leanlm.analysis.model_shape import PRESETS, ModelShape
from leanlm.cli import main

MIXTRAL = PRESETS["mixtral-8x7b"]
MOE64 = ModelShape("moe64", 1000, 64, 64, 4, 4, 4, 16, num_experts=64, experts_per_token=6)


def layout(p: int, g: int, intra=(400e9, 5e-6), inter=(50e9, 10e-6)) -> ExpertParallelLayout:
    return ExpertParallelLayout(p, g, *intra, *inter)


def test_message_counts_flat_against_hierarchical():
    lay = layout(64, 8)  # 8 nodes of 8
    flat, hier = flat_all_to_all(1.0, lay), hierarchical_all_to_all(1.0, lay)
    assert (flat.intra_messages, flat.inter_messages) == (7, 56)  # P - 1 peers, P - n of them off the node
    assert (hier.intra_messages, hier.inter_messages) == (7, 7)  # n - 1 + G - 1
    assert hier.inter_bytes == pytest.approx(flat.inter_bytes) == pytest.approx(7 / 8)
    assert hier.intra_bytes == pytest.approx(8 * flat.intra_bytes)  # G times the intra-node bytes
    one_node = layout(8, 1)
    assert flat_all_to_all(1.0, one_node) == hierarchical_all_to_all(1.0, one_node)


def _simulate(p: int, g: int, copies_per_rank: int, seed: int = 0) -> dict[str, list[int]]:
    """Route copies (one per chosen expert) of each rank's tokens through both algorithms, counting the copies each
    rank sends across and within nodes and the distinct peers it sends to."""
    rng = random.Random(seed)
    n = p // g
    dest = {r: [rng.randrange(p) for _ in range(copies_per_rank)] for r in range(p)}
    out = {"flat_inter": [], "flat_intra": [], "hier_inter": [], "hier_intra": []}
    held: dict[int, list[int]] = {r: [] for r in range(p)}  # after phase 1: copies on their relay rank
    for r in range(p):
        node = r // n
        out["flat_inter"].append(sum(1 for d in dest[r] if d // n != node))
        out["flat_intra"].append(sum(1 for d in dest[r] if d // n == node and d != r))
        relay = [node * n + d % n for d in dest[r]]  # phase 1: to the node's rank with the destination's local index
        out["hier_intra"].append(sum(1 for x in relay if x != r))
        for x, d in zip(relay, dest[r]):
            held[x].append(d)
    for r in range(p):  # phase 2: each relay sends to the final rank, same local index, on its node
        assert all(d % n == r % n for d in held[r])
        out["hier_inter"].append(sum(1 for d in held[r] if d // n != r // n))
    return out


def test_formulas_match_a_simulated_exchange():
    p, g, copies = 16, 4, 20000
    sim = _simulate(p, g, copies)
    lay = layout(p, g)
    flat, hier = flat_all_to_all(copies, lay), hierarchical_all_to_all(copies, lay)
    mean = {k: sum(v) / p for k, v in sim.items()}
    assert sum(sim["flat_inter"]) == sum(sim["hier_inter"])  # every off-node copy crosses nodes once, either way
    assert mean["flat_inter"] == pytest.approx(flat.inter_bytes, rel=0.02)
    assert mean["flat_intra"] == pytest.approx(flat.intra_bytes, rel=0.05)
    assert mean["hier_intra"] == pytest.approx(hier.intra_bytes, rel=0.02)
    assert mean["hier_inter"] == pytest.approx(hier.inter_bytes, rel=0.02)


def test_step_cost_for_mixtral_on_two_nodes():
    lay = layout(8, 2)
    c = expert_parallel_cost(MIXTRAL, lay, num_tokens=64, act_bytes=2)
    a = rank_payload_bytes(MIXTRAL, 64, lay, 2)
    assert a == 64 / 8 * 2 * 4096 * 2
    assert c.dispatch_bytes_per_rank == c.combine_bytes_per_rank == pytest.approx(a * 7 / 8)
    assert (c.flat_messages_per_rank, c.flat_inter_node_messages_per_rank) == (7, 4)
    assert (c.hierarchical_messages_per_rank, c.hierarchical_inter_node_messages_per_rank) == (4, 1)
    assert c.experts_per_rank == 1 and c.moe_layers == 32
    per_direction = 3 * 5e-6 + 4 * 10e-6 + a / 8 * 3 / 400e9 + a * 4 / 8 / 50e9
    assert c.flat_step_s == pytest.approx(2 * 32 * per_direction)
    assert c.hierarchical_step_s < c.flat_step_s  # decode-sized messages: latency-bound, fewer messages win


def test_hierarchical_loses_when_intra_node_bytes_dominate():
    slow_intra = layout(64, 8, intra=(1e9, 0.0), inter=(50e9, 0.0))
    c = expert_parallel_cost(MOE64, slow_intra, num_tokens=1 << 16)
    assert c.hierarchical_step_s > c.flat_step_s


def test_layout_and_model_errors_say_what_to_do():
    with pytest.raises(ValueError, match="divide --expert-parallel-size"):
        layout(8, 3)
    with pytest.raises(ValueError, match=">= 2"):
        layout(1, 1)
    with pytest.raises(ValueError, match="must divide the 8 experts"):
        expert_parallel_cost(MIXTRAL, layout(16, 2), 8)
    with pytest.raises(ValueError, match="no experts"):
        expert_parallel_cost(PRESETS["llama-7b"], layout(2, 1), 8)


def test_cli_reports_the_all_to_all(capsys):
    args = ["estimate", "--model", "mixtral-8x7b", "--expert-parallel-size", "8", "--expert-parallel-nodes", "2"]
    assert main([*args, "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "EP=8 on 2 node(s) x 4, 1 expert(s) per rank" in out and "7 (4 inter)" in out and "4 (1 inter)" in out
    assert main([*args, "--json", "--inter-node-latency-us", "20"]) == 0
    ep = json.loads(capsys.readouterr().out)["moe"]["expert_parallel"]
    assert ep["inter_latency_s"] == pytest.approx(20e-6) and [c["num_tokens"] for c in ep["by_batch"]] == [1, 64]
    assert main(["estimate", "--model", "llama-7b", "--expert-parallel-size", "2"]) != 0
    assert "has no experts" in capsys.readouterr().err
