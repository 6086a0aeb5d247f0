"""Channel permutation for N:M: the search keeps more score than the identity (never less), and folding an
order into the model leaves its outputs unchanged."""

import itertools

import pytest
import torch

from leanlm.compress import MagnitudeConfig, PermuteConfig, WandaConfig, compress
from leanlm.compress.prune.permute import _best_swaps, kept_score, search_permutation
from tests.compress.conftest import dense_logits


def _brute_best_swap(s: torch.Tensor, pair: torch.Tensor, n: int) -> float:
    """Best gain of swapping one column between the two groups of `pair` [2, m], by recomputing top-n."""
    base = kept_score(s[:, pair.flatten()], n, pair.shape[1])
    best = -float("inf")
    for i, j in itertools.product(range(pair.shape[1]), repeat=2):
        a, b = pair[0].clone(), pair[1].clone()
        a[i], b[j] = pair[1][j], pair[0][i]
        best = max(best, kept_score(s[:, torch.cat([a, b])], n, pair.shape[1]) - base)
    return best


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 4), (4, 8)])
def test_swap_gains_match_recomputing_the_groups(n, m):
    g = torch.Generator().manual_seed(0)
    s = torch.rand(24, 8 * m, generator=g)
    pairs = torch.randperm(8 * m, generator=g).view(-1, 2, m)
    a_idx, b_idx = (t.flatten() for t in torch.meshgrid(torch.arange(m), torch.arange(m), indexing="ij"))
    gains, _ = _best_swaps(s.t().contiguous(), pairs, n, a_idx, b_idx)
    for pair, gain in zip(pairs, gains, strict=True):
        assert gain.item() == pytest.approx(_brute_best_swap(s, pair, n), abs=1e-4)


def test_search_finds_the_order_a_scrambled_pattern_hides():
    # rows whose large entries sit 2 per group of 4 in some order; scrambled, magnitude 2:4 loses them
    g = torch.Generator().manual_seed(1)
    k = 32
    good = torch.rand(64, k, generator=g) * 0.1
    good.view(64, k // 4, 4)[:, :, :2] += 1.0  # the first two of every group are large, in every row
    scrambled = good[:, torch.randperm(k, generator=g)]
    perm = search_permutation(scrambled, 2, 4, max_rounds=300, patience=50)
    assert sorted(perm.tolist()) == list(range(k))
    before, after, ideal = kept_score(scrambled, 2, 4), kept_score(scrambled[:, perm], 2, 4), kept_score(good, 2, 4)
    assert before < 0.9 * ideal and after > 0.99 * ideal
    # never worse than the identity, even with nothing to find
    flat = torch.ones(8, 16)
    assert kept_score(flat[:, search_permutation(flat, 2, 4)], 2, 4) == kept_score(flat, 2, 4)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("score", ["magnitude", "wanda"])
def test_folded_orders_leave_the_model_outputs_unchanged(tiny_model, calib, heads, kv_heads, score):
    model = tiny_model(torch.float64, heads=heads, kv_heads=kv_heads)
    before = dense_logits(model, calib)
    embed = model.model.embed_tokens.weight.clone()
    report = compress(model, PermuteConfig(pattern="2:4", score=score), calib, progress=False)
    assert set(report.details["permute"]) == {"hidden", "down_proj", "o_proj"}
    assert all(gain >= 0 for gain in report.details["permute"].values())
    assert not torch.equal(model.model.embed_tokens.weight, embed)  # the residual stream was reordered
    if model.config.tie_word_embeddings:  # the head stays one tensor with the embedding
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.allclose(dense_logits(model, calib), before, atol=1e-10, rtol=0)


def test_permuting_first_keeps_more_magnitude_under_24(tiny_model, calib):
    kept = {}
    for recipe in (
        [MagnitudeConfig(pattern="2:4", pack=False)],
        [PermuteConfig(), MagnitudeConfig(pattern="2:4", pack=False)],
    ):
        model = tiny_model()
        total = sum(m.weight.abs().sum() for n, m in model.named_modules() if n.endswith(("_proj",)))
        compress(model, recipe, calib, progress=False)
        kept[len(recipe)] = sum(m.weight.abs().sum() for n, m in model.named_modules() if n.endswith("_proj")) / total
    assert kept[2] > kept[1]


def test_permute_refuses_quantized_layers_and_bad_settings(tiny_model):
    from leanlm.compress import RTNConfig

    with pytest.raises(ValueError, match="before any quantizer"):
        compress(tiny_model(), [RTNConfig(bits=8), PermuteConfig()], progress=False)
    with pytest.raises(ValueError, match="score"):
        PermuteConfig(score="hessian")
    with pytest.raises(ValueError, match="pattern"):
        PermuteConfig(pattern="4:2")


def test_wanda_permuted_recipe_from_the_cli_builder():
    from leanlm.compress.named_recipes import build_prune_recipe

    recipe = build_prune_recipe("wanda", pattern="2:4", permute=True)
    assert recipe == [PermuteConfig(pattern="2:4", score="wanda"), WandaConfig(pattern="2:4")]
    with pytest.raises(ValueError, match="add --pattern"):
        build_prune_recipe("wanda", sparsity=0.5, permute=True)


def test_methods_after_a_permutation_calibrate_on_the_reordered_model(tiny_model, calib):
    # in one recipe, Wanda must see the same inputs as when it runs on the already permuted model
    one = tiny_model()
    compress(one, [PermuteConfig(), WandaConfig(pattern="2:4", pack=False)], calib, progress=False)
    two = tiny_model()
    compress(two, PermuteConfig(), calib, progress=False)
    compress(two, WandaConfig(pattern="2:4", pack=False), calib, progress=False)
    for (name, a), b in zip(one.named_parameters(), two.parameters(), strict=True):
        assert torch.equal(a, b), name
