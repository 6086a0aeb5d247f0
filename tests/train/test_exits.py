"""Early-exit heads on a frozen tiny model: config validation, training lowers the exits' held-out KL and leaves
the model alone, resumption, confidence measures and threshold calibration, the checkpoint round trip, and
self-speculation through a trained exit giving plain greedy output."""

import dataclasses

import pytest
import torch

from leanlm.cli import main
from leanlm.config import EngineConfig
from leanlm.engine.engine import LLMEngine
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.llm import load_model
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from leanlm.train.exits import (
    ExitHeadsConfig,
    ExitObjective,
    ExitStatistics,
    attach_exits,
    calibrate_threshold,
    exit_statistics,
    saturation,
    softmax_max,
    top2_gap,
)
from leanlm.train.model import load_trainable
from leanlm.train.trainer import TrainConfig, Trainer
from tests.compress.conftest import dense_logits
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict
from tests.train.conftest import SEQ_LEN, VOCAB, run_interrupted

EXITS = ExitHeadsConfig(layers=(1, 2))


def _model(vocab=VOCAB, seed=0, dtype=torch.float32):
    cfg = dataclasses.replace(tiny_config(vocab), num_hidden_layers=4)
    return build_model(cfg, tiny_state_dict(cfg, seed), dtype)


def _config(steps=30, **kw):
    return TrainConfig(
        tokens=SEQ_LEN * 4 * steps, seq_len=SEQ_LEN, batch_size=4, grad_accum=1, lr=1e-2, warmup_steps=0, **kw
    )


def _kl(model, windows):
    return {k: s.mean_kl for k, s in exit_statistics(model, windows).items()}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(layers=()), "increasing"),
        (dict(layers=(16, 8)), "increasing"),
        (dict(layers=(0, 8)), "increasing"),
        (dict(temperature=0.0), "temperature > 0"),
        (dict(adapter_rank=-1), "adapter_rank >= 0"),
    ],
)
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExitHeadsConfig(**kwargs)


def test_an_exit_at_or_past_the_last_layer_is_refused():
    with pytest.raises(ValueError, match="more layers"):
        attach_exits(_model(), ExitHeadsConfig(layers=(2, 4)))


@pytest.mark.parametrize("rank", [0, 8])
def test_fresh_exits_equal_the_untrained_exit(rank):
    model = attach_exits(_model(), ExitHeadsConfig(layers=(1, 2), adapter_rank=rank))
    ids = torch.randint(0, VOCAB, (7,))
    for k in (1, 2):
        draft, untrained = model.first_layers(k), _model().first_layers(k)
        torch.testing.assert_close(dense_logits(draft, ids[None]), dense_logits(untrained, ids[None]))


@pytest.mark.parametrize("rank", [0, 8])
def test_training_lowers_held_out_kl_and_leaves_the_model_alone(windows, rank):
    model = _model()
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    exits = ExitHeadsConfig(layers=(1, 2), adapter_rank=rank, ce_weight=0.1)
    attach_exits(model, exits)
    before = _kl(model, windows.held_out)
    trainer = Trainer(model, windows, _config(), progress=False, objective=ExitObjective(exits))
    result = trainer.run()
    after = _kl(model, windows.held_out)
    for k in (1, 2):
        assert after[k] < 0.9 * before[k]
    assert result.held_out[-1][1] == pytest.approx(after, rel=0.02)  # the loop evaluates under bf16 autocast
    assert result.tokens == SEQ_LEN * 4 * 30 and trainer.recipe_step()["objective"]["method"] == "exits"
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.exits."):
            assert torch.equal(tensor, frozen[name]), name


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(windows, tmp_path):
    config = _config(steps=6, save_every=1, dtype="float32")
    whole = attach_exits(_model(), EXITS)
    Trainer(whole, windows, config, progress=False, objective=ExitObjective(EXITS)).run()
    state = tmp_path / "state.pt"
    run_interrupted(
        Trainer(attach_exits(_model(), EXITS), windows, config, None, state, False, ExitObjective(EXITS)).run, 3
    )
    other = ExitObjective(ExitHeadsConfig(layers=(1, 2), ce_weight=0.5))
    with pytest.raises(ValueError, match="other settings"):
        Trainer(attach_exits(_model(), EXITS), windows, config, None, state, False, other).run()
    resumed = attach_exits(_model(), EXITS)
    result = Trainer(resumed, windows, config, None, state, False, ExitObjective(EXITS)).run()
    assert result.resumed_from == 3 and result.steps == 6
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_confidence_measures():
    logits = torch.tensor([[10.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert softmax_max(logits)[0] > 0.99 and softmax_max(logits)[1] == pytest.approx(0.4223, abs=1e-4)
    assert top2_gap(logits)[1] == pytest.approx(0.0, abs=1e-6) and top2_gap(logits)[0] > 0.99
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert torch.allclose(saturation(x, torch.tensor([[2.0, 0.0], [0.0, 3.0]])), torch.tensor([1.0, 0.0]))


def test_calibration_picks_the_smallest_threshold_that_keeps_the_consistency():
    # confidences 0.9 .. 0.1; the five most confident agree, then a miss, then agreement again
    conf = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    agrees = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0], dtype=torch.bool)
    stats = ExitStatistics(3, torch.zeros(9), agrees, {"softmax": conf})
    strict = calibrate_threshold(stats, "softmax", 1.0)
    assert (strict.threshold, strict.exit_fraction, strict.agreement) == (0.5, 5 / 9, 1.0)
    loose = calibrate_threshold(stats, "softmax", 0.85)  # 6 of 7 agree at 0.3
    assert loose.threshold == pytest.approx(0.3) and loose.exit_fraction == pytest.approx(7 / 9)
    assert loose.agreement == pytest.approx(6 / 7)
    never = ExitStatistics(3, torch.zeros(2), torch.tensor([False, True]), {"softmax": torch.tensor([0.9, 0.1])})
    assert calibrate_threshold(never, "softmax", 0.95).threshold is None


@pytest.mark.parametrize("rank", [0, 8])
def test_checkpoint_round_trip_gives_identical_exit_logits(windows, tmp_path, tokenizer, rank):
    model = _model()
    exits = ExitHeadsConfig(layers=(1, 2), adapter_rank=rank)
    attach_exits(model, exits)
    Trainer(model, windows, _config(steps=5), progress=False, objective=ExitObjective(exits)).run()
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path / "ckpt", dtype=torch.float32)
    loaded = load_model(str(tmp_path / "ckpt"), dtype="float32", progress=False)
    assert loaded.config.exit_layers == (1, 2) and loaded.config.exit_adapter_rank == rank
    want, got = exit_statistics(model, windows.held_out), exit_statistics(loaded, windows.held_out)
    for k in (1, 2):
        assert torch.equal(want[k].kl, got[k].kl)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_checkpoint_without_exits_loads_as_before(tmp_path, tokenizer):
    save_checkpoint(Checkpoint(_model(), tokenizer), tmp_path / "plain", dtype=torch.float32)
    loaded = load_model(str(tmp_path / "plain"), dtype="float32", progress=False)
    assert loaded.config.exit_layers == () and len(loaded.model.exits) == 0
    assert "leanlm_exits" not in (tmp_path / "plain" / "config.json").read_text()


def _engine(model, tokenizer, **options):
    return LLMEngine(model, tokenizer, EngineConfig.from_options(**options), torch.device("cpu"), torch.float64)


def test_self_speculation_drafts_through_a_trained_exit_with_plain_greedy_output(tokenizer):
    model = _model(tokenizer.vocab_size, dtype=torch.float64)
    attach_exits(model, ExitHeadsConfig(layers=(1, 2), adapter_rank=4))
    with torch.no_grad():  # a trained exit differs from the final norm: make it so, visibly
        for head in model.model.exits.values():
            head.norm.weight.mul_(1.5)
            head.adapter.up_proj.weight.normal_(std=0.05)
    draft = model.first_layers(2)
    assert draft.model.norm is model.model.exits["2"].norm and draft.head_adapter is model.model.exits["2"].adapter
    assert model.first_layers(3).model.norm is model.model.norm  # no exit there: the final norm, as before
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for spec in (None, "self:2", "self:1"):
        engine = _engine(model, tokenizer, speculative=spec, block_size=4, num_kv_blocks=40)
        ids = [engine.add_request(p, greedy) for p in prompts]
        done = run_to_completion(engine)
        outputs[spec] = [done[i].outputs[0].token_ids for i in ids]
        if spec is not None:
            assert engine.model_runner.spec_decoder.stats().num_draft_tokens > 0
    assert outputs["self:2"] == outputs[None] and outputs["self:1"] == outputs[None]


TEXT = " ".join(f"The clockmaker made clock number {i} for the village." for i in range(400))


def test_the_command_trains_exits_into_a_checkpoint_generate_drafts_with(tmp_path, tokenizer, capsys):
    cfg = dataclasses.replace(tiny_config(tokenizer.vocab_size), num_hidden_layers=4)
    src = save_checkpoint(
        Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), tmp_path / "src"
    )
    data, out = tmp_path / "text.txt", tmp_path / "exits"
    data.write_text(TEXT)
    argv = ["train", "--model", str(src), "--exits", "1,3", "--exit-adapter-rank", "4", "--data", str(data)]
    argv += ["--seq-len", "32", "--tokens", str(32 * 8 * 3), "--lr", "1e-2", "--out", str(out)]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "exit 1: KL" in report and "exit 3: KL" in report and "95%" in report
    assert not (out / "train_state.pt").exists()
    assert main(["generate", "--model", str(out), "--speculative", "self:3", "--max-tokens", "8", "Hello"]) == 0
    loaded = load_trainable(out)
    assert loaded.config.exit_layers == (1, 3) and loaded.recipe[-1]["objective"]["method"] == "exits"


def test_the_command_refuses_exits_with_a_recipe(tmp_path, capsys):
    argv = ["train", "--exits", "8", "--recipe", "gmp", "--out", str(tmp_path / "o")]
    assert main(argv) == 2 and "does not combine" in capsys.readouterr().err
    assert main(["train", "--exits", "8,x", "--out", str(tmp_path / "o")]) == 2
    assert "separated by commas" in capsys.readouterr().err
