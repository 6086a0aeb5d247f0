"""Distillation: the top-k teacher cache (exact bins, computed once, refused for another teacher), the loss
against full-vocabulary references, a student that learns its teacher, a resumable run, and the command."""

import json

import pytest
import torch
import torch.nn.functional as F

from leanlm.cli import main
from leanlm.compress import save_checkpoint
from leanlm.model.llama import build_model
from leanlm.train.distill import DistillConfig, DistillObjective, distillation_loss_sum, prepare_teacher, rows_read
from leanlm.train.forward import logits
from leanlm.train.student import keep_layers
from leanlm.train.teacher_cache import TeacherCache, TeacherTargets, top_k_distribution
from leanlm.train.trainer import TrainConfig, Trainer
from tests.conftest import tiny_config, tiny_state_dict
from tests.train.conftest import SEQ_LEN, VOCAB, run_interrupted, teacher_divergence

TEXT = " ".join(f"The clockmaker made clock number {i} for the village." for i in range(400))


def test_config_refuses_bad_values():
    for bad in ({"top_k": 0}, {"temperature": 0.0}, {"kd_weight": 1.5}, {"divergence": "js"}):
        with pytest.raises(ValueError):
            DistillConfig(**bad)


def test_top_k_bins_are_the_teachers_distribution(tiny_model):
    model = tiny_model(dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    full = torch.log_softmax(logits(model, ids)[:, :-1] / 2.0, dim=-1)  # [B, T-1, V]
    index, logprobs, tail = top_k_distribution(model, ids, 8, temperature=2.0)
    assert index.shape == (2, 11, 8) and tail.shape == (2, 11)
    torch.testing.assert_close(logprobs, full.gather(-1, index))
    assert torch.equal(index, full.topk(8, dim=-1).indices)
    rest = full.exp().sum(-1) - full.gather(-1, index).exp().sum(-1)
    torch.testing.assert_close(tail.exp(), rest)


def _targets(teacher_logits, k):
    logp = torch.log_softmax(teacher_logits, -1)
    top, index = logp.topk(k, -1)
    rest = torch.log((1 - top.exp().sum(-1)).clamp_min(1e-12))
    return TeacherTargets(index, top, rest)


def test_loss_matches_full_vocabulary_references():
    gen = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(5, 40, generator=gen, dtype=torch.float64), torch.randn(5, 40, generator=gen)
    student = student.double()
    targets = torch.randint(0, 40, (5,), generator=gen)
    every = _targets(teacher, 40)  # all 40 tokens listed: the tail is empty and the bins are the distribution
    p, q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    forward = distillation_loss_sum(student, targets, every, DistillConfig(top_k=40))
    torch.testing.assert_close(forward.double(), (p.exp() * (p - q)).sum(), rtol=1e-5, atol=1e-6)
    reverse = distillation_loss_sum(student, targets, every, DistillConfig(top_k=40, divergence="reverse"))
    torch.testing.assert_close(reverse.double(), (q.exp() * (q - p)).sum(), rtol=1e-5, atol=1e-6)
    hard = distillation_loss_sum(student, targets, every, DistillConfig(kd_weight=0.0))
    torch.testing.assert_close(hard, F.cross_entropy(student, targets, reduction="sum"))
    assert float(distillation_loss_sum(teacher, targets, _targets(teacher, 4), DistillConfig())) < 1e-5
    # fewer bins lose detail, never invent divergence: KL over a coarsening is at most the full KL
    assert float(distillation_loss_sum(student, targets, _targets(teacher, 4), DistillConfig())) <= float(forward)


def _windows_and_config(windows, steps=4):
    cfg = TrainConfig(tokens=SEQ_LEN * 2 * steps, seq_len=SEQ_LEN, batch_size=2, grad_accum=1, lr=3e-3, dtype="float32")
    return windows, cfg


def test_cache_is_computed_once_and_matches_the_teacher(tiny_model, windows, tmp_path):
    teacher = tiny_model()
    data, cfg = _windows_and_config(windows)
    config = DistillConfig(top_k=6)
    cache = prepare_teacher(teacher, "tiny", data, cfg, config, tmp_path / "cache", progress=False)
    rows = sorted(rows_read(data, cfg))
    assert sorted(p.name for p in (tmp_path / "cache").glob("window_*.pt")) == [f"window_{r:07d}.pt" for r in rows]
    got = cache.targets(rows[:3], torch.device("cpu"))
    index, logprobs, tail = top_k_distribution(teacher, data.train[rows[:3]], 6, 1.0)
    assert torch.equal(got.indices, index)
    torch.testing.assert_close(got.logprobs, logprobs, atol=2e-3, rtol=1e-3)  # float16 on disk
    torch.testing.assert_close(got.tail, tail)
    again = TeacherCache(tmp_path / "cache", cache.identity)
    assert again.build(teacher, data.train, set(rows), 2, progress=False) == 0  # nothing left to compute
    other = TeacherCache.identity_of("another", data.train, 6, 1.0, cfg.dtype)
    with pytest.raises(ValueError, match="another --teacher-cache"):
        TeacherCache(tmp_path / "cache", other)


def test_a_student_learns_its_teacher(tiny_model, windows, tmp_path):
    teacher = tiny_model(seed=4)
    student = keep_layers(teacher, [1])
    assert student.config.num_hidden_layers == 1
    data, cfg = _windows_and_config(windows, steps=30)
    config = DistillConfig(top_k=16)
    objective = DistillObjective(config, prepare_teacher(teacher, "t", data, cfg, config, tmp_path / "c", False))

    before = teacher_divergence(teacher, student, data.held_out)
    Trainer(student, data, cfg, objective=objective, progress=False).run()
    assert teacher_divergence(teacher, student, data.held_out) < 0.7 * before
    recipe = student.compression_recipe
    assert recipe[-2] == {"method": "keep_layers", "layers": [1]} and recipe[-1]["objective"]["method"] == "distill"


def test_resumed_distillation_equals_an_uninterrupted_one(tiny_model, windows, tmp_path):
    teacher = tiny_model(seed=4)
    data, cfg = _windows_and_config(windows, steps=4)
    cfg = TrainConfig(**{**cfg.__dict__, "save_every": 1})
    config = DistillConfig(top_k=8, kd_weight=0.5, temperature=2.0)
    objective = DistillObjective(config, prepare_teacher(teacher, "t", data, cfg, config, tmp_path / "c", False))
    straight = keep_layers(teacher, [0])
    Trainer(straight, data, cfg, objective=objective, progress=False).run()

    state = tmp_path / "state.pt"
    run_interrupted(Trainer(keep_layers(teacher, [0]), data, cfg, None, state, False, objective).run, at_step=2)
    resumed = keep_layers(teacher, [0])
    result = Trainer(resumed, data, cfg, None, state, False, objective).run()
    assert result.resumed_from == 2 and result.steps == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other = DistillObjective(DistillConfig(top_k=8, kd_weight=1.0, temperature=2.0), objective.cache)
    with pytest.raises(ValueError, match="other settings"):
        Trainer(keep_layers(teacher, [0]), data, cfg, None, state, False, other).run()


def test_keep_layers_is_the_teachers_computation(tiny_model):
    teacher = tiny_model(dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    same = keep_layers(teacher, list(range(teacher.config.num_hidden_layers)))
    torch.testing.assert_close(logits(same, ids), logits(teacher, ids))
    with pytest.raises(ValueError, match="distinct indices"):
        keep_layers(teacher, [0, 0])


def test_distill_command_makes_a_student_the_engine_loads(tmp_path, tokenizer, capsys):
    from leanlm.llm import load_model

    cfg = tiny_config(tokenizer.vocab_size)
    teacher = save_checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tmp_path / "t", tokenizer)
    data, out = tmp_path / "text.txt", tmp_path / "student"
    data.write_text(TEXT)
    argv = ["distill", "--teacher", str(teacher), "--data", str(data), "--seq-len", "32", "--top-k", "8"]
    argv += ["--tokens", str(32 * 8 * 2), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "teacher cache" in printed and "2 steps, 512 tokens" in printed
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == cfg.num_hidden_layers // 2
    recipe = json.loads((out / "quantization_config.json").read_text())["recipe"]
    assert [step["method"] for step in recipe] == ["keep_layers", "train"]
    assert load_model(str(out), progress=False).config.num_hidden_layers == cfg.num_hidden_layers // 2
    # the same run again reuses the cache: no teacher windows computed
    files = sorted((out / "teacher_cache").glob("window_*.pt"))
    stamps = [p.stat().st_mtime_ns for p in files]
    assert main([*argv[:-4], "--out", str(tmp_path / "again"), "--teacher-cache", str(out / "teacher_cache")]) == 0
    assert [p.stat().st_mtime_ns for p in files] == stamps
    assert main([*argv, "--keep-layers", "0,9"]) == 2
    assert "distinct indices" in capsys.readouterr().err


def test_distill_into_a_quantized_student(tmp_path, tokenizer, capsys):
    from leanlm.compress import RTNConfig, compress
    from leanlm.llm import load_model

    cfg = tiny_config(tokenizer.vocab_size)
    float_dir = save_checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tmp_path / "t", tokenizer)
    quantized = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    compress(quantized, RTNConfig(bits=4, group_size=32), progress=False)
    int4 = save_checkpoint(quantized, tmp_path / "int4", tokenizer)
    data, out = tmp_path / "text.txt", tmp_path / "qat"
    data.write_text(TEXT)
    argv = ["distill", "--teacher", str(float_dir), "--student", str(int4), "--qat", "--data", str(data)]
    argv += ["--seq-len", "32", "--top-k", "8", "--lr", "1e-3", "--tokens", str(32 * 8 * 2), "--out", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0
    assert "quantization-aware distillation" in capsys.readouterr().out
    trained = load_model(str(out), progress=False).model.layers[0].mlp.up_proj
    before = quantized.model.layers[0].mlp.up_proj
    assert type(trained) is type(before) and trained.bits == 4
    assert not torch.equal(trained.dequantized_weight(), before.dequantized_weight())
    assert main(["distill", "--teacher", str(float_dir), "--qat", "--out", str(tmp_path / "bad")]) == 2
    assert "pass it with --student" in capsys.readouterr().err
