"""leanlm.compress.jobs.run_compress(CompressJob) without the CLI: a job runs and saves a checkpoint that loads,
and an inconsistent job is refused on construction (before any model loads)."""

from __future__ import annotations

import pytest

from leanlm.compress import ActivationSparsityConfig, GPTQConfig, MagnitudeConfig, RTNConfig
from leanlm.compress.jobs import CompressJob, run_compress
from leanlm.formats import Checkpoint, save_checkpoint


def test_a_compress_job_runs_without_the_cli(tmp_path, tiny_model, tokenizer):
    from leanlm.llm import load_model
    from leanlm.model.linear.sparse24 import Sparse24Linear

    source = save_checkpoint(Checkpoint(tiny_model(vocab=tokenizer.vocab_size), tokenizer), tmp_path / "dense")
    job = CompressJob(tmp_path / "pruned", [MagnitudeConfig(pattern="2:4")], model=str(source), device="cpu")
    assert not job.needs_calibration
    result = run_compress(job)
    assert result.report.methods == ["magnitude"] and "50.0%" in result.summary
    # the held-out perplexity before and after is measured and said (a 2:4 random tiny model: any finite change)
    assert result.quality.num_tokens == 2 * 255 and result.quality.ppl_before > 1
    assert "quality check: WikiText-2 perplexity" in result.summary
    assert isinstance(load_model(str(result.out), progress=False).model.layers[0].mlp.down_proj, Sparse24Linear)


@pytest.mark.parametrize(
    "recipe,options,message",
    [
        ([], {}, "empty recipe"),
        ([RTNConfig(bits=4)], {"format": "gguf"}, "unknown checkpoint format"),
        ([RTNConfig(bits=4)], {"calib": "/no/such/file"}, "does not exist"),
        ([RTNConfig(bits=8)], {"format": "gptq"}, "4-bit weight-only"),
        ([GPTQConfig(bits=4)], {"format": "gptq"}, "--symmetric"),
        ([MagnitudeConfig(), RTNConfig(bits=4)], {"format": "compressed-tensors"}, "pruned float weights"),
        ([ActivationSparsityConfig()], {"format": "compressed-tensors"}, "pruned float weights"),
        ([RTNConfig(bits=4)], {"num_samples": 0}, "num_samples >= 1"),
    ],
)
def test_an_inconsistent_compress_job_is_refused(recipe, options, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        CompressJob(tmp_path / "out", recipe, **options)
    assert not (tmp_path / "out").exists()


def test_the_quality_check_warns_when_perplexity_more_than_doubles():
    from leanlm.compress.quality import QualityCheck

    fine = QualityCheck(20.0, 21.0, 510)
    assert not fine.is_broken and "+5.0%" in fine.describe() and "WARNING" not in fine.describe()
    broken = QualityCheck(27.69, 1465.9, 510)  # 2:4 magnitude + 4-bit RTN on SmolLM2-135M, measured
    assert broken.is_broken and "WARNING: perplexity grew more than 2x" in broken.describe()
    assert QualityCheck(20.0, float("nan"), 510).is_broken


def test_a_job_refuses_its_output_before_the_run(tmp_path):
    from leanlm.formats.output_dir import OutputDirError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(OutputDirError, match="is inside"):
        CompressJob(out=model / "q", recipe=(RTNConfig(bits=8),), model=str(model), overwrite=True)
    with pytest.raises(OutputDirError, match="not empty"):
        CompressJob(out=model, recipe=(RTNConfig(bits=8),))
    with pytest.raises(TypeError, match=r"recipe=\(RTNConfig"):
        CompressJob(out=tmp_path / "q", recipe=RTNConfig(bits=8))
    with pytest.raises(TypeError, match="holds method configs"):
        CompressJob(out=tmp_path / "q", recipe=("rtn",))
    assert CompressJob(out=model, recipe=(RTNConfig(bits=8),), overwrite=True).overwrite
