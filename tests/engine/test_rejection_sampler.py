"""Speculative verification: greedy keeps the argmax prefix; sampling keeps the target distribution exactly
(chi-square on a small vocabulary, with a biased rule shown to fail the same test)."""

from __future__ import annotations

import math

import pytest
import torch

from leanlm.engine.rejection_sampler import RejectionSampler
from leanlm.engine.request import Request
from leanlm.engine.sampling_metadata import SamplingMetadata
from leanlm.sampling_params import SamplingParams

V = 6
N = 40_000


def metadata(num_rows: int, **params) -> SamplingMetadata:
    request = Request("r", [1], SamplingParams(**params))
    return SamplingMetadata.from_requests([request] * num_rows, V, "cpu")


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of samples [n] against probs [V] (categories with mass > 0; an empty one fails)."""
    counts = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * samples.numel()
    if (counts[expected == 0] > 0).any():
        return 0.0
    keep = expected > 0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: chi2(dof) as a normal, accurate enough for a pass/fail at p ~ 1e-4
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P1 = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])


def test_greedy_accepts_the_argmax_prefix_then_corrects():
    logits = torch.tensor([[0, 5, 0, 0, 0, 0], [0, 0, 5, 0, 0, 0], [0, 0, 0, 0, 5, 0]], dtype=torch.float32)
    out = RejectionSampler()(logits, metadata(3, temperature=0.0), [[1, 3]])
    assert out.token_ids == [[1, 2]] and out.num_accepted == [1]  # 3 rejected, replaced by row 1's argmax 2
    logits[1] = torch.tensor([0, 0, 0, 5, 0, 0])
    out = RejectionSampler()(logits, metadata(3, temperature=0.0), [[1, 3]])
    assert out.token_ids == [[1, 3, 4]] and out.num_accepted == [2]  # all accepted plus the bonus token


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_certain_drafts_keep_the_target_distribution(draft):
    """n-gram drafts (q is a point mass): the first token is distributed as p0 whatever the draft, and the
    token after an accepted draft as p1."""
    torch.manual_seed(draft)
    rows = torch.stack([P0.log(), P1.log(), P1.log()]).repeat(N, 1)  # N requests x (2 drafts + bonus)
    out = RejectionSampler()(rows, metadata(3 * N, temperature=1.0), [[draft, 2]] * N)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi_square_pvalue(first, P0) > 1e-4
    second = torch.tensor([t[1] for t in out.token_ids if t[0] == draft])
    assert chi_square_pvalue(second, P1) > 1e-4
    accept_rate = sum(a > 0 for a in out.num_accepted) / N
    assert abs(accept_rate - P0[draft].item()) < 0.02  # min(1, p/q) with q(draft) = 1


def test_a_biased_rule_fails_the_same_test():
    """The power check: accepting every draft makes the first token the draft, which the test rejects; so does
    accepting with probability 1/2 regardless of p."""
    torch.manual_seed(0)
    always = torch.full((N,), 3)
    assert chi_square_pvalue(always, P0) < 1e-6
    coin = torch.where(torch.rand(N) < 0.5, torch.full((N,), 3), torch.multinomial(P0, N, replacement=True))
    assert chi_square_pvalue(coin, P0) < 1e-6


def test_sampled_drafts_keep_the_target_distribution():
    """A draft model's tokens, drawn from q: accept with min(1, p/q), else resample from max(0, p - q)."""
    torch.manual_seed(1)
    q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.20, 0.20])
    drafts = torch.multinomial(q, N, replacement=True)
    logits = torch.stack([P0.log(), P1.log()]).repeat(N, 1)
    draft_probs = torch.stack([q, torch.zeros(V)]).repeat(N, 1)
    out = RejectionSampler()(logits, metadata(2 * N, temperature=1.0), [[int(d)] for d in drafts], draft_probs)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi_square_pvalue(first, P0) > 1e-4
    expected_accept = torch.minimum(P0, q).sum().item()  # P(accept) = sum_x min(p(x), q(x))
    assert abs(sum(out.num_accepted) / N - expected_accept) < 0.02


def test_top_k_and_temperature_shape_the_target():
    """Verification samples from the processed distribution: temperature 0.5 and top-k 2 over P0."""
    torch.manual_seed(2)
    rows = torch.stack([P0.log(), P1.log()]).repeat(N, 1)
    out = RejectionSampler()(rows, metadata(2 * N, temperature=0.5, top_k=2), [[1]] * N)
    target = torch.zeros(V)
    target[:2] = P0[:2] ** 2 / (P0[:2] ** 2).sum()
    assert chi_square_pvalue(torch.tensor([t[0] for t in out.token_ids]), target) > 1e-4


def test_seeded_rows_are_reproducible():
    logits = torch.stack([P0.log(), P1.log()])
    runs = [RejectionSampler()(logits, metadata(2, temperature=1.0, seed=7), [[2]]).token_ids for _ in range(3)]
    torch.manual_seed(123)  # the global generator does not matter to seeded rows
    runs.append(RejectionSampler()(logits, metadata(2, temperature=1.0, seed=7), [[2]]).token_ids)
    assert all(r == runs[0] for r in runs)


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logit rows"):
        RejectionSampler()(torch.zeros(2, V), metadata(2, temperature=0.0), [[1, 2]])
