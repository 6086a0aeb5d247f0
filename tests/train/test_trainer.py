"""The fine-tuning loop: config validation, schedule, learning, and resumption that reproduces a run exactly."""

import pytest
import torch

from leanlm.train.sparse import GMPConfig
from leanlm.train.trainer import TrainConfig, Trainer, train
from tests.train.conftest import SEQ_LEN, run_interrupted


def config(**kw):
    base = dict(tokens=SEQ_LEN * 4 * 2 * 6, seq_len=SEQ_LEN, lr=3e-3, warmup_steps=1, eval_every=2, save_every=2)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(tokens=100), "less than one optimizer step"),
        (dict(dtype="float16"), "dtype must be one of"),
        (dict(batch_size=0), "batch_size must be >= 1"),
        (dict(lr=0.0), "lr > 0"),
    ],
)
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        config(**kw)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(tokens=4096 * 100, seq_len=512, batch_size=4, grad_accum=2, lr=1e-4, warmup_steps=10)
    assert cfg.total_steps == 100
    rates = [cfg.lr_at(s) for s in range(100)]
    assert rates[:10] == sorted(rates[:10]) and rates[9] < 1e-4
    assert rates[10] == pytest.approx(1e-4) and rates[10:] == sorted(rates[10:], reverse=True)
    assert rates[-1] == pytest.approx(1e-5, rel=0.01)


def test_training_lowers_the_held_out_loss_and_records_itself(tiny_model, windows):
    model = tiny_model()
    before = Trainer(tiny_model(), windows, config(), progress=False).held_out_loss()
    trainer = Trainer(model, windows, config(), progress=False)
    result = trainer.run()
    assert result.steps == 6 and result.tokens == 6 * SEQ_LEN * 8 and len(result.losses) == 6
    assert [s for s, _ in result.held_out] == [2, 4, 6]
    assert result.held_out[-1][1] < 0.5 * before
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert trainer.recipe_step()["method"] == "train" and trainer.recipe_step()["lr"] == 3e-3
    assert not hasattr(model, "compression_recipe")  # the recipe travels in a Checkpoint, not on the model


def test_a_resumed_run_ends_exactly_where_an_uninterrupted_one_does(tiny_model, windows, tmp_path):
    sparsity = GMPConfig(pattern="2:4", every=1, end=0.8)
    straight = tiny_model()
    train(straight, windows, config(), sparsity, progress=False)

    state = tmp_path / "state.pt"
    run_interrupted(lambda: train(tiny_model(), windows, config(), sparsity, state, progress=False), at_step=3)
    resumed = tiny_model()
    result = train(resumed, windows, config(), sparsity, state, progress=False)
    assert result.resumed_from == 2 and result.steps == 6 and len(result.losses) == 6
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_wall_clock_budget_stops_the_run_and_a_resumed_run_keeps_to_it(tiny_model, windows, tmp_path):
    state = tmp_path / "state.pt"
    result = train(tiny_model(), windows, config(max_seconds=1e-9), None, state, progress=False)
    assert result.steps == 1 and result.tokens == SEQ_LEN * 8 and result.held_out[-1][0] == 1
    again = train(tiny_model(), windows, config(max_seconds=1e-9), None, state, progress=False)
    assert again.resumed_from == 1 and again.steps == 1  # its time was spent: nothing more trains
    with pytest.raises(ValueError, match="max_seconds must be >= 0"):
        config(max_seconds=-1.0)


def test_a_state_from_other_settings_is_not_resumed(tiny_model, windows, tmp_path):
    state = tmp_path / "state.pt"
    train(tiny_model(), windows, config(tokens=SEQ_LEN * 8 * 2), None, state, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        train(tiny_model(), windows, config(lr=1e-3, tokens=SEQ_LEN * 8 * 2), None, state, progress=False)


def test_fake_quantized_grids_learn_at_their_own_rate(tiny_model, windows):
    from leanlm.compress import RTNConfig, compress
    from leanlm.model.quantized.fake_quant import GRID_LR_SCALE
    from leanlm.train.qat import attach_fake_quant

    model = tiny_model()
    compress(model, [RTNConfig(bits=4, group_size=32)], progress=False)
    attach_fake_quant(model)
    trainer = Trainer(model, windows, config(tokens=SEQ_LEN * 4 * 2), progress=False)
    trainer._step(3)
    rates = {id(p): g["lr"] for g in trainer.optimizer.param_groups for p in g["params"]}
    up = model.model.layers[0].mlp.up_proj
    assert rates[id(up.scale)] == rates[id(up.offset)] == pytest.approx(GRID_LR_SCALE * rates[id(up.weight)])
    assert rates[id(up.weight)] == pytest.approx(trainer.config.lr_at(3)) and rates[id(up.weight)] > 0


class _Payload:
    """Unpickling this writes a file: a planted state must never get that far."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_state_is_refused_without_running_its_code(tiny_model, windows, tmp_path):
    state, marker = tmp_path / "state.pt", tmp_path / "payload-ran"
    torch.save({"config": _Payload(marker)}, state)
    with pytest.raises(ValueError, match="not a training state LeanLM wrote"):
        train(tiny_model(), windows, config(tokens=SEQ_LEN * 8 * 2), None, state, progress=False)
    assert not marker.exists()
