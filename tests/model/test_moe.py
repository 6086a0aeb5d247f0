"""The sparse MLP: routing, capacity with and without batch priority, grouped dispatch against a per-token
reference, the shared expert, the expert mask and the load counters."""

import dataclasses

import pytest
import torch

from leanlm.config.moe import MoEConfig, RoutingPolicy
from leanlm.model.context import ExpertRouting, build_forward_context, forward_context
from leanlm.model.llama import build_model
from leanlm.model.moe import capacity_keep, load_balancing_loss, moe_stats, route
from leanlm.model.paged_kv import PagedKVCache
from tests.conftest import tiny_config, tiny_state_dict

MOE = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=32)


def moe_model(moe: MoEConfig = MOE, seed: int = 0):
    config = dataclasses.replace(tiny_config(97), moe=moe)
    return build_model(config, tiny_state_dict(config, seed), torch.float64)


def block_of(model, layer: int = 0):
    return model.model.layers[layer].mlp


def per_token_reference(block, x: torch.Tensor) -> torch.Tensor:
    """Each token alone through its k experts: what grouped dispatch must equal."""
    routing = route(block.gate(x), block.moe)
    rows = []
    for t in range(x.shape[0]):
        y = sum(w * block.experts[int(e)](x[t : t + 1]) for e, w in zip(routing.experts[t], routing.weights[t]))
        rows.append(y)
    out = torch.cat(rows)
    if block.shared_expert is not None:
        shared = block.shared_expert(x)
        out = out + (torch.sigmoid(block.shared_expert_gate(x)) * shared if block.shared_expert_gate else shared)
    return out


@pytest.mark.parametrize(
    "moe",
    [
        MOE,
        dataclasses.replace(MOE, scoring="softmax", shared_expert_intermediate_size=48, shared_expert_gate=True),
        dataclasses.replace(MOE, top_k=1, scoring="ones", shared_expert_intermediate_size=40),
    ],  # fmt: skip
)
def test_grouped_dispatch_equals_per_token_reference(moe):
    block = block_of(moe_model(moe))
    x = torch.randn(19, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(block(x), per_token_reference(block, x), atol=1e-12, rtol=0)
    assert sum(block.stats.load) == 19 * moe.top_k and block.stats.tokens == 19 and block.stats.dropped == 0


def test_scorings():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    soft = route(logits, dataclasses.replace(MOE, scoring="softmax"))
    renorm = route(logits, MOE)
    ones = route(logits, dataclasses.replace(MOE, scoring="ones"))
    assert soft.experts.tolist() == [[0, 1]] and soft.weights.sum() < 1
    torch.testing.assert_close(renorm.weights.sum(), torch.tensor(1.0))
    assert ones.weights.tolist() == [[1.0, 1.0]]
    masked = route(logits, MOE, mask=torch.tensor([[False, True, False, True]]))
    assert masked.experts.tolist() == [[1, 3]] and masked.probs[0, 0] == 0


def test_capacity_goes_to_first_choices_then_token_order_or_priority():
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])  # [T=4, k=2]
    keep = capacity_keep(experts, capacity=2, num_experts=3, priority=None)
    # expert 0: first choices of tokens 0, 1 fill it, so token 2's first choice and token 3's second are dropped;
    # expert 1 takes token 3's first choice, then token 0's second; token 1's second is one too many
    assert keep[:, 0].tolist() == [True, True, False, True]
    assert keep[:, 1].tolist() == [True, False, True, False]
    bpr = capacity_keep(experts, capacity=2, num_experts=3, priority=torch.tensor([0.1, 0.2, 0.9, 0.5]))
    # by priority token 2 (0.9) then 1 (0.2) keep expert 0; token 0 (0.1) loses it
    assert bpr[:, 0].tolist() == [False, True, True, True]


def test_capacity_factor_drops_are_counted_and_fall_to_the_residual():
    model = moe_model()
    block = block_of(model)
    x = torch.randn(32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    full = block(x)
    dropped_before = block.stats.dropped
    limited = block(x, ExpertRouting(RoutingPolicy(capacity_factor=0.5)))
    dropped = block.stats.dropped - dropped_before
    assert dropped > 0 and max(block.stats.load) <= 2 * 32 * 2  # counters accumulate over both calls
    assert (limited - full).abs().amax(dim=1).gt(0).sum() > 0
    routing = route(block.gate(x), block.moe)
    capacity = RoutingPolicy(0.5).capacity(32, 2, 4)
    keep = capacity_keep(routing.experts, capacity, 4, None)
    assert int((~keep).sum()) == dropped
    fully_dropped = ~keep.any(dim=1)  # such a token gets nothing from the block: only its residual carries on
    assert torch.all(limited[fully_dropped] == 0)


def test_routing_policy_validation():
    with pytest.raises(ValueError, match="capacity_factor"):
        RoutingPolicy(capacity_factor=0.0)
    with pytest.raises(ValueError, match="set a capacity_factor"):
        RoutingPolicy(batch_priority=True)
    assert RoutingPolicy(1.25).capacity(num_tokens=10, top_k=2, num_experts=8) == 4


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_skewed():
    uniform = torch.full((8, 4), 0.25)
    assert float(load_balancing_loss(uniform, torch.arange(8).remainder(4)[:, None])) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert float(load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long))) > 2


def test_expert_mask_from_the_forward_context_limits_experts_and_stats():
    model = moe_model()
    cfg = model.config
    cache = PagedKVCache.allocate(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, 4, cfg.head_dim,
                                  torch.float64, "cpu")  # fmt: skip
    ctx = build_forward_context([6], [6], [[0, 1]], cache)
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[:, [1, 3]] = True
    with forward_context(dataclasses.replace(ctx, routing=ExpertRouting(mask=mask))):
        model(torch.arange(6), torch.arange(6))
    stats = moe_stats(model)
    assert all(load[0] == 0 and load[2] == 0 for load in stats.expert_load)
    assert stats.tokens == 6 and stats.assignments == 6 * 2 * 2 and stats.dropped == 0
    expert_bytes = 3 * 64 * 32 * 8  # one float64 expert
    assert stats.expert_bytes_per_token == pytest.approx(2 * 2 * expert_bytes / 6)  # 2 layers x 2 experts, 6 tokens


def test_dense_model_has_no_moe_stats():
    config = tiny_config(97)
    assert moe_stats(build_model(config, tiny_state_dict(config), torch.float64)) is None


def test_bench_counts_only_the_top_k_experts_a_batch1_step_reads():
    from leanlm.analysis.bench_suite import batch1_weight_elements

    model = moe_model()
    experts = sum(p.numel() for b in (block_of(model, 0), block_of(model, 1)) for p in b.experts.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert batch1_weight_elements(model) == total - experts / 2  # top-2 of 4: half the experts stay unread
