"""Training-time sparsity: the gradient each method gives the dense weight, how its masks move, and that the
result is the pruned model one-shot pruning would leave (zeros, `sparsity_mask`, 2:4 packing)."""

import pytest
import torch
from torch import nn

from leanlm.compress.prune.pruner import pack_semi_structured
from leanlm.compress.prune.sparsity import SparsityScheme, nm_mask, satisfies_nm
from leanlm.model.linear.sparse24 import Sparse24Linear
from leanlm.model.sparsity_mask import MASK_ATTR
from leanlm.train.recipes import build_sparse_training
from leanlm.train.sparse import (
    GMPConfig,
    MaskedConfig,
    RewindConfig,
    SRSTEConfig,
    TopKASTConfig,
    schedule_mask,
)
from leanlm.train.trainer import TrainConfig, Trainer, train
from tests.train.conftest import SEQ_LEN

STEPS = 8


def config(**kw):
    return TrainConfig(tokens=SEQ_LEN * 8 * STEPS, seq_len=SEQ_LEN, lr=3e-3, warmup_steps=1, eval_every=0, **kw)


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def test_schedule_mask_grows_towards_the_final_pattern():
    scores = torch.rand(8, 16, generator=torch.Generator().manual_seed(0))
    final = nm_mask(scores, 2, 4)
    scheme = SparsityScheme(pattern="2:4")
    assert torch.equal(schedule_mask(scores, scheme, 1.0), final)
    half = schedule_mask(scores, scheme, 0.5)
    assert int(half.sum()) == 32 and bool((half <= final).all())  # a subset of the final mask...
    assert scores[half].max() <= scores[final & ~half].min()  # ...its lowest scores first
    assert int(schedule_mask(scores, SparsityScheme(sparsity=0.75), 0.5).sum()) == 48


def test_gmp_follows_the_cubic_schedule():
    gmp = build_sparse_training(GMPConfig(sparsity=0.8, start=0.1, end=0.5))
    assert gmp.fraction(10, 100) == 0 and gmp.fraction(50, 100) == 1 and gmp.fraction(90, 100) == 1
    assert gmp.fraction(30, 100) == pytest.approx(1 - 0.5**3)  # s_t = s_f (1 - (1 - p)^3)


@pytest.mark.parametrize(
    "sparsity,expected",
    [
        (GMPConfig(pattern="2:4", every=2, end=0.5), 0.5),
        (SRSTEConfig(pattern="2:4"), 0.5),
        (TopKASTConfig(sparsity=0.75, backward_sparsity=0.5), 0.75),
        (RewindConfig(sparsity=0.6, rounds=2), 0.6),
        (GMPConfig(sparsity=0.7, every=1), 0.7),
    ],
)
def test_each_method_ends_at_its_sparsity_with_zeros_and_masks(tiny_model, windows, sparsity, expected):
    model = tiny_model()
    result = train(model, windows, config(), sparsity, progress=False)
    assert result.sparsity["sparsity"] == pytest.approx(expected, abs=1e-3)
    for name, linear in linears(model).items():
        mask = getattr(linear, MASK_ATTR)
        assert not hasattr(linear, "parametrizations"), name
        assert torch.equal(mask, linear.weight == 0) and linear.weight.mean().abs() < 1  # trained values, not nans
        assert abs(float(mask.float().mean()) - expected) < 0.01, name
        if sparsity.pattern == "2:4":
            assert satisfies_nm(linear.weight, 2, 4), name
    assert model.model.embed_tokens.weight.count_nonzero() == model.model.embed_tokens.weight.numel()
    if sparsity.pattern == "2:4":
        pack_semi_structured(model, [])
        assert sum(isinstance(m, Sparse24Linear) for m in model.modules()) == 14


def grad_of(method, weight, upstream):
    """The gradient `method` gives a dense weight [N, K] for the upstream gradient of the masked weight."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.clone())
    holder = nn.Sequential(linear)
    method.attach(holder)
    method.refresh(0, 10)
    masked = linear.weight
    (masked * upstream).sum().backward()
    return masked.detach(), method.dense("0").grad, method.params["0"]


def test_sr_ste_passes_the_dense_gradient_plus_decay_on_pruned_weights():
    w, g = torch.randn(4, 8), torch.randn(4, 8)
    masked, grad, param = grad_of(build_sparse_training(SRSTEConfig(pattern="2:4", decay=0.1)), w, g)
    keep = ~nm_mask(w.abs(), 2, 4)
    assert torch.equal(param.keep, keep) and torch.equal(masked, w * keep)
    torch.testing.assert_close(grad, g + 0.1 * w * ~keep)


def test_sr_ste_masks_follow_the_weights():
    method = build_sparse_training(SRSTEConfig(pattern="2:4"))
    w = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    _, _, param = grad_of(method, w, torch.zeros_like(w))
    with torch.no_grad():
        method.dense("0").copy_(torch.tensor([[4.0, 0.5, 2.0, 5.0]]))  # a pruned weight grew past a kept one
    method.refresh(1, 10)
    assert param.keep.tolist() == [[True, False, False, True]]


def test_top_kast_updates_the_backward_set_only_and_explores_with_more_decay():
    w = torch.arange(1.0, 17.0).view(2, 8)  # |w| ranks are the values
    g = torch.ones(2, 8)
    cfg = TopKASTConfig(sparsity=0.75, backward_sparsity=0.5, decay=0.1)
    masked, grad, param = grad_of(build_sparse_training(cfg), w, g)
    assert int(param.keep.sum()) == 4 and int(param.grad_keep.sum()) == 8
    assert torch.equal(masked != 0, w > 12)
    expected = torch.where(w > 12, 1 + 0.1 * w, torch.where(w > 8, 1 + 0.1 * w / 0.25, torch.zeros_like(w)))
    torch.testing.assert_close(grad, expected)


def test_masked_fine_tuning_keeps_the_zeros_it_was_given(tiny_model, windows):
    model = tiny_model()
    with torch.no_grad():
        for linear in linears(model).values():
            linear.weight.masked_fill_(nm_mask(linear.weight.abs(), 2, 4), 0.0)
    zeros = {n: (m.weight == 0).clone() for n, m in linears(model).items()}
    before = {n: m.weight.clone() for n, m in linears(model).items()}
    train(model, windows, config(), MaskedConfig(pattern="2:4"), progress=False)
    for name, linear in linears(model).items():
        assert torch.equal(linear.weight == 0, zeros[name]) and not torch.equal(linear.weight, before[name])


def test_masked_fine_tuning_of_a_dense_model_says_to_prune_first(tiny_model, windows):
    with pytest.raises(ValueError, match="prune first"):
        Trainer(tiny_model(), windows, config(), MaskedConfig(), progress=False)


def test_rewinding_resets_the_kept_weights_to_the_start(tiny_model, windows):
    model = tiny_model()
    start = {n: m.weight.clone() for n, m in linears(model).items()}
    trainer = Trainer(model, windows, config(), RewindConfig(sparsity=0.5, rounds=2), progress=False)
    rewinding = trainer.sparse
    optimizer = trainer.optimizer
    for step in range(STEPS):  # 2 prunings: the first after a third of the run
        trainer._step(step)
        if trainer.optimizer is not optimizer:  # the first round ended: moments reset with the weights
            break
    assert step + 1 == -(-STEPS // 3)
    for name in start:
        keep = rewinding.params[name].keep
        assert 0.25 < 1 - float(keep.float().mean()) < 0.35  # 1 - sqrt(0.5) of the weights pruned in round 1
        assert torch.equal(rewinding.dense(name).detach(), start[name] * keep)
    for later in range(step + 1, STEPS):  # the second pruning, then the last third trains the final subnetwork
        trainer._step(later)
    for name in start:
        keep = rewinding.params[name].keep
        assert abs(1 - float(keep.float().mean()) - 0.5) < 0.01
        trained = rewinding.dense(name).detach()
        assert torch.equal(trained[~keep], torch.zeros_like(trained[~keep]))
        assert not torch.equal(trained, start[name] * keep)  # the ticket was trained after its rewind
