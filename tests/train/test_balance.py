"""The load-balancing loss of MoE training: it gives the routers a gradient the next-token loss does not (upcycled
experts are identical copies, so the LM loss cannot tell the router anything yet), it is off at coefficient 0,
the trainer counts every assignment, and an MoE run resumes exactly."""

import pytest
import torch

from leanlm.compress import UpcycleConfig, compress
from leanlm.model.forward import causal_lm_loss
from leanlm.train.balance import LayerLoad, RoutingBalance, add_load, describe_load, layer_loads
from leanlm.train.trainer import TrainConfig, Trainer, train
from tests.train.conftest import SEQ_LEN, run_interrupted


def upcycled(tiny_model, coef=0.01, dtype=torch.float32, **kw):
    model = tiny_model(dtype)
    compress(model, [UpcycleConfig(num_experts=4, router_aux_loss_coef=coef, **kw)], progress=False)
    return model


def config(**kw):
    base = dict(tokens=SEQ_LEN * 4 * 2 * 4, seq_len=SEQ_LEN, lr=3e-3, warmup_steps=1, eval_every=2, save_every=2)
    return TrainConfig(**{**base, **kw})


def _router_grads(model) -> list[torch.Tensor]:
    return [layer.mlp.gate.weight.grad for layer in model.model.layers]


def test_the_router_learns_from_the_balancing_loss_not_from_identical_experts(tiny_model):
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model = upcycled(tiny_model, coef=0.1, dtype=torch.float64).train().requires_grad_(True)
    causal_lm_loss(model, ids).backward()
    # sum_k w_k = 1 over copies of one MLP: the output does not depend on the router, but for the float32
    # rounding of the routing weights (route() computes them in float32, as HF's routers do)
    assert all(float(g.abs().max()) < 1e-6 for g in _router_grads(model))
    model.zero_grad()
    balance = RoutingBalance.of(model)
    (causal_lm_loss(model, ids) + balance.coef * balance.loss()).backward()
    assert all(float(g.abs().max()) > 1e-4 for g in _router_grads(model))
    expert = model.model.layers[0].mlp.experts[0].up_proj.weight.grad
    assert expert is not None and float(expert.abs().max()) > 0


def test_at_coefficient_zero_the_loss_is_the_next_token_loss(tiny_model, windows):
    ids = windows.train[:2]
    for coef in (0.0, 0.5):
        model = upcycled(tiny_model, coef=coef, dtype=torch.float64)
        trainer = Trainer(model, windows, config(grad_accum=1), progress=False)
        lm = causal_lm_loss(model, ids)
        total = trainer.lm_loss(ids)
        aux = trainer.result.balance_losses[-1]  # the unweighted term of this forward
        assert 0.5 < aux < 4  # E * sum f P: 1.0 at uniform routing, E when one expert takes everything
        torch.testing.assert_close(total, lm + coef * aux, rtol=1e-6, atol=0)  # the term is float32
        if coef == 0.0:
            assert torch.equal(total, lm)


def test_a_dense_model_trains_without_the_term(tiny_model, windows):
    trainer = Trainer(tiny_model(), windows, config(), progress=False)
    assert trainer.balance is None
    result = trainer.run()
    assert result.expert_load == {} and result.balance_losses == []


def test_the_run_counts_every_assignment_and_balancing_spreads_them(tiny_model, windows):
    loads = {}
    for coef in (0.0, 1.0):
        model = upcycled(tiny_model, coef=coef, router_std=1.0)  # a router with opinions from the start
        result = Trainer(model, windows, config(lr=1e-2), progress=False).run()
        assert sorted(result.expert_load) == [0, 1] and len(result.balance_losses) == result.steps == 4
        assert all(sum(row) == result.tokens * 2 for row in result.expert_load.values())  # top-2 of each position
        loads[coef] = layer_loads(result.expert_load)
    cv = {coef: sum(x.cv for x in ls) / len(ls) for coef, ls in loads.items()}
    assert cv[1.0] < cv[0.0]


def test_an_moe_run_resumes_exactly(tiny_model, windows, tmp_path):
    straight = upcycled(tiny_model)
    expected = train(straight, windows, config(), None, progress=False)
    state = tmp_path / "state.pt"
    run_interrupted(lambda: train(upcycled(tiny_model), windows, config(), None, state, progress=False), at_step=3)
    resumed = upcycled(tiny_model)
    result = train(resumed, windows, config(), None, state, progress=False)
    assert result.resumed_from == 2 and result.expert_load == expected.expert_load
    assert result.balance_losses == pytest.approx(expected.balance_losses, rel=1e-6)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_load_figures():
    even, skewed = LayerLoad(0, (0.25,) * 4), LayerLoad(3, (0.7, 0.1, 0.1, 0.1))
    assert even.max_over_mean == 1.0 and even.cv == 0.0
    # deviations from 1/4: 0.45 and three -0.15; population variance 0.27 / 4; std over the mean 1/4: sqrt(1.08)
    assert skewed.max_over_mean == pytest.approx(2.8) and skewed.cv == pytest.approx(1.08**0.5, rel=1e-9)
    assert layer_loads({3: [7, 1, 1, 1], 0: [1, 1, 1, 1]}) == [even, skewed]
    assert add_load({0: [1, 2]}, {0: [1, 1], 2: [0, 3]}) == {0: [2, 3], 2: [0, 3]}
    assert "worst 2.80 (layer 3)" in describe_load([even, skewed])


def test_loss_without_a_forward_says_what_to_do(tiny_model):
    balance = RoutingBalance.of(upcycled(tiny_model))
    with pytest.raises(RuntimeError, match="grad enabled"):
        balance.loss()
