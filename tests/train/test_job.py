"""leanlm.train.run(TrainJob) and run_distill(DistillJob) without the CLI: a job runs, resumes from its state,
and an inconsistent job is refused on construction (before any model loads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leanlm.compress import GQAConfig, RTNConfig, UpcycleConfig
from leanlm.formats import Checkpoint, save_checkpoint
from leanlm.model.llama import build_model
from leanlm.train import DistillJob, TrainJob, run, run_distill
from leanlm.train.distill import DistillConfig
from leanlm.train.exits import ExitHeadsConfig
from leanlm.train.sparse import GMPConfig, SRSTEConfig
from leanlm.train.trainer import TrainConfig
from tests.conftest import tiny_config, tiny_state_dict
from tests.train.test_command import TEXT


@pytest.fixture
def dense_and_text(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    dense = save_checkpoint(
        Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), tmp_path / "dense"
    )
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    return dense, data


def test_a_train_job_runs_without_the_cli_and_resumes(dense_and_text, tmp_path):
    from leanlm.llm import load_model

    dense, data = dense_and_text
    out = tmp_path / "gmp"
    train = TrainConfig(tokens=32 * 8 * 2, seq_len=32, save_every=1)
    job = TrainJob(
        out, model=str(dense), train=train, sparsity=GMPConfig(sparsity=0.5), data=str(data), keep_state=True
    )
    logged = []
    report = run(job, log=logged.append)
    assert report.result.steps == 2 and "gmp" in report.summary and logged == []
    assert job.state_path.is_file() and load_model(str(out), progress=False) is not None
    # the same job again finds the finished run's state: it resumes there (nothing left to train), then cleans up
    again = dataclasses.replace(job, keep_state=False)
    report = run(again, log=logged.append)
    assert logged == [f"resuming from {job.state_path}"] and report.result.resumed_from == 2
    assert report.result.steps == 2 and not job.state_path.exists()


def test_a_distill_job_runs_without_the_cli(dense_and_text, tmp_path):
    dense, data = dense_and_text
    train = TrainConfig(tokens=32 * 8, seq_len=32)
    job = DistillJob(tmp_path / "student", teacher=str(dense), num_student_layers=1, train=train, data=str(data))
    logged = []
    report = run_distill(job, log=logged.append)
    assert "distillation (1 layers" in report.summary and logged[0].startswith("teacher cache")
    assert job.cache_dir == tmp_path / "student" / "teacher_cache" and job.cache_dir.is_dir()


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(qat=RTNConfig(bits=4), train_quantized=True), "pick one"),
        (dict(qat=RTNConfig(bits=4), sparsity=SRSTEConfig(pattern="2:4")), "does not combine with --recipe sr-ste"),
        (dict(exits=ExitHeadsConfig((1,)), gqa=GQAConfig()), "trains heads on a frozen model"),
        (dict(data="/no/such/file"), "does not exist"),
        (dict(sparsity=RTNConfig(bits=4)), "one of the training configs"),
        (dict(upcycle=UpcycleConfig(), sparsity=GMPConfig(sparsity=0.5)), "upcycle and fine-tune first"),
        (dict(upcycle=UpcycleConfig(), train_quantized=True), "does not combine with"),
    ],
)
def test_an_inconsistent_train_job_is_refused(options, message, tmp_path):
    with pytest.raises((ValueError, TypeError), match=message):
        TrainJob(tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(student="some/dir", num_student_layers=2), "name the student one way"),
        (dict(qat=True), "pass it with --student"),
        (dict(data="/no/such/file", distill=DistillConfig()), "does not exist"),
    ],
)
def test_an_inconsistent_distill_job_is_refused(options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        DistillJob(tmp_path / "out", **options)


def test_a_job_never_writes_over_its_inputs_or_another_model(dense_and_text, tmp_path):
    from leanlm.formats.output_dir import OutputDirError
    from leanlm.train.job import STATE_FILE

    dense, data = dense_and_text
    with pytest.raises(OutputDirError, match="which this run reads"):
        TrainJob(dense, model=str(dense), data=str(data), overwrite=True)
    with pytest.raises(OutputDirError, match="which this run reads"):
        DistillJob(dense / "student", teacher=str(dense), data=str(data), overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(OutputDirError, match="not empty"):
        TrainJob(other, model=str(dense), data=str(data))
    with pytest.raises(OutputDirError, match="not empty"):
        DistillJob(other, teacher=str(dense), data=str(data))
    assert TrainJob(other, model=str(dense), data=str(data), overwrite=True).overwrite
    # a directory holding a run's state is that run's own: it resumes there without --overwrite
    (other / STATE_FILE).write_bytes(b"")
    assert TrainJob(other, model=str(dense), data=str(data)).state_path.is_file()


def test_each_runner_takes_its_own_job(tmp_path):
    with pytest.raises(TypeError, match=r"run takes a TrainJob, got DistillJob; a DistillJob runs with run_distill"):
        run(DistillJob(tmp_path / "d"))
    with pytest.raises(TypeError, match=r"run_distill takes a DistillJob, got TrainJob; a TrainJob runs with run\("):
        run_distill(TrainJob(tmp_path / "t"))
    with pytest.raises(TypeError, match="run takes a TrainJob, got dict"):
        run({"out": str(tmp_path / "t")})
