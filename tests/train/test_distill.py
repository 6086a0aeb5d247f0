"""Distillation: the top-k teacher cache (exact bins, computed once, refused for another teacher), the loss
against full-vocabulary references, a student that learns its teacher, a resumable run, and the command."""

import json

import pytest
import torch
import torch.nn.functional as F

from leanlm.cli import main
from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.model.forward import hidden_states, logits
from leanlm.model.llama import build_model
from leanlm.train.distill import (
    DistillConfig,
    DistillObjective,
    cosine_distance_sum,
    distillation_loss_sum,
    prepare_teacher,
    rows_read,
)
from leanlm.train.student import keep_layers, student_of
from leanlm.train.teacher_cache import TeacherCache, TeacherTargets, top_k_distribution
from leanlm.train.trainer import TrainConfig, Trainer
from tests.conftest import tiny_config, tiny_state_dict
from tests.train.conftest import SEQ_LEN, VOCAB, run_interrupted, teacher_divergence

TEXT = " ".join(f"The clockmaker made clock number {i} for the village." for i in range(400))


def test_config_refuses_bad_values():
    for bad in ({"top_k": 0}, {"temperature": 0.0}, {"kd_weight": 1.5}, {"divergence": "js"}, {"cosine_weight": -1}):
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


def test_cosine_loss_and_the_cached_hidden_states(tiny_model, windows, tmp_path):
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(6, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    expected = sum(
        1 - float(a[i] @ b.reshape(6, 16)[i]) / float(a[i].norm() * b.reshape(6, 16)[i].norm()) for i in range(6)
    )
    assert float(cosine_distance_sum(a, b)) == pytest.approx(expected, rel=1e-5)
    assert float(cosine_distance_sum(a, 3 * a)) == pytest.approx(0.0, abs=1e-5)  # blind to scale
    with pytest.raises(ValueError, match="one width"):
        cosine_distance_sum(a, torch.randn(6, 8))
    with pytest.raises(ValueError, match="no hidden states"):
        cosine_distance_sum(a, None)

    teacher = tiny_model()
    data, cfg = _windows_and_config(windows)
    plain = prepare_teacher(teacher, "tiny", data, cfg, DistillConfig(top_k=6), tmp_path / "plain", progress=False)
    with pytest.raises(ValueError, match="without the teacher's hidden states"):
        prepare_teacher(teacher, "tiny", data, cfg, DistillConfig(top_k=6, cosine_weight=1.0), plain.directory)
    cache = prepare_teacher(
        teacher, "tiny", data, cfg, DistillConfig(top_k=6, cosine_weight=1.0), tmp_path / "c", progress=False
    )
    rows = sorted(rows_read(data, cfg))[:3]
    got = cache.targets(rows, torch.device("cpu"))
    torch.testing.assert_close(got.hidden, hidden_states(teacher, data.train[rows])[:, :-1], atol=2e-3, rtol=1e-3)
    assert plain.targets(rows, torch.device("cpu")).hidden is None
    # a cache with hidden states serves a run without the cosine term, and keeps them for the windows it adds
    served = prepare_teacher(
        teacher, "tiny", data, _windows_and_config(windows, 8)[1], DistillConfig(top_k=6), cache.directory, False
    )
    assert (
        served.identity["hidden_states"]
        and served.targets(sorted(rows_read(data, _windows_and_config(windows, 8)[1])), torch.device("cpu")).hidden
        is not None
    )


def test_the_cosine_term_pulls_the_students_hidden_states_to_the_teachers(tiny_model, windows, tmp_path):
    teacher = tiny_model(seed=4)
    data, cfg = _windows_and_config(windows, steps=30)

    def distance(model):
        with torch.no_grad():
            return float(
                cosine_distance_sum(
                    hidden_states(model, data.held_out).reshape(-1, 64), hidden_states(teacher, data.held_out)
                )
            )

    ends = {}
    for weight in (10.0, 0.0):  # the cache built for the cosine term serves the run without it
        config = DistillConfig(top_k=16, cosine_weight=weight)
        cache = prepare_teacher(teacher, "t", data, cfg, config, tmp_path / "c", False)
        student = keep_layers(teacher, [1])
        start = distance(student)
        Trainer(student, data, cfg, objective=DistillObjective(config, cache), progress=False).run()
        ends[weight] = distance(student)
    assert ends[10.0] < 0.6 * start and ends[10.0] < 0.7 * ends[0.0]


def test_a_student_learns_its_teacher(tiny_model, windows, tmp_path):
    teacher = tiny_model(seed=4)
    student = keep_layers(teacher, [1])
    assert student.config.num_hidden_layers == 1
    data, cfg = _windows_and_config(windows, steps=30)
    config = DistillConfig(top_k=16)
    objective = DistillObjective(config, prepare_teacher(teacher, "t", data, cfg, config, tmp_path / "c", False))

    before = teacher_divergence(teacher, student, data.held_out)
    trainer = Trainer(student, data, cfg, objective=objective, progress=False)
    trainer.run()
    assert teacher_divergence(teacher, student, data.held_out) < 0.7 * before
    assert trainer.recipe_step()["objective"]["method"] == "distill"


def test_a_student_checkpoint_records_its_layers_after_the_teachers_recipe(tiny_model, tokenizer):
    teacher = Checkpoint(tiny_model(seed=4), tokenizer, ({"method": "rtn", "bits": 8},))
    student = student_of(teacher, [1])
    assert student.config.num_hidden_layers == 1 and student.tokenizer is tokenizer
    assert student.recipe == ({"method": "rtn", "bits": 8}, {"method": "keep_layers", "layers": [1]})


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
    teacher = save_checkpoint(
        Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), tmp_path / "t"
    )
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
    assert main([*argv[:-4], "--out", str(tmp_path / "third"), "--device", "cpu", "--keep-layers", "0,9"]) == 2
    assert "distinct indices" in capsys.readouterr().err
    # the finished run's directory (no state left) is not written over without --overwrite
    assert main(argv) == 2
    assert "is not empty" in capsys.readouterr().err


def test_distill_into_a_quantized_student(tmp_path, tokenizer, capsys):
    from leanlm.compress import RTNConfig, compress
    from leanlm.llm import load_model

    cfg = tiny_config(tokenizer.vocab_size)
    float_dir = save_checkpoint(
        Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), tmp_path / "t"
    )
    quantized = build_model(cfg, tiny_state_dict(cfg), torch.float32)
    compress(quantized, RTNConfig(bits=4, group_size=32), progress=False)
    int4 = save_checkpoint(Checkpoint(quantized, tokenizer), tmp_path / "int4")
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


def test_a_wider_teacher_and_the_cosine_flag(tmp_path, tokenizer, capsys):
    """A larger teacher sharing the tokenizer (Qwen2.5-Coder-1.5B -> 0.5B, as the issue names) distils into a
    narrower student; the cosine term, which needs one width, is refused for that pair and runs for a same-width
    student cut from the teacher."""
    import dataclasses

    small = tiny_config(tokenizer.vocab_size)
    wide = dataclasses.replace(small, hidden_size=96, intermediate_size=192, num_hidden_layers=3, head_dim=24)
    teacher = save_checkpoint(
        Checkpoint(build_model(wide, tiny_state_dict(wide, 1), torch.float32), tokenizer), tmp_path / "t"
    )
    student = save_checkpoint(
        Checkpoint(build_model(small, tiny_state_dict(small), torch.float32), tokenizer), tmp_path / "s"
    )
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    argv = ["distill", "--teacher", str(teacher), "--data", str(data), "--seq-len", "32", "--top-k", "8"]
    argv += ["--tokens", str(32 * 8 * 2), "--device", "cpu"]
    assert main([*argv, "--student", str(student), "--out", str(tmp_path / "kd")]) == 0
    assert "forward KL on the top 8" in capsys.readouterr().out
    assert main([*argv, "--student", str(student), "--cosine-weight", "0.2", "--out", str(tmp_path / "bad")]) == 2
    assert "one width" in capsys.readouterr().err
    assert main([*argv, "--cosine-weight", "0.2", "--kd-weight", "0.7", "--out", str(tmp_path / "cos")]) == 0
    assert "hidden-state cosine, weight 0.2" in capsys.readouterr().out
    assert json.loads((tmp_path / "cos" / "teacher_cache" / "meta.json").read_text())["hidden_states"] is True
