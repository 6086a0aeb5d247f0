"""`leanlm quantize`: recipes behind each method, and bad input refused before any model is loaded."""

import pytest

from leanlm.cli import main
from leanlm.compress import AWQConfig, GPTQConfig, RTNConfig, SmoothQuantConfig
from leanlm.compress.named_recipes import build_recipe
from leanlm.formats.checkpoint import Checkpoint


def test_recipes_behind_the_methods():
    assert build_recipe("rtn", bits=8) == [RTNConfig(bits=8, group_size=None)]
    awq = build_recipe("awq")
    assert [type(c) for c in awq] == [AWQConfig, RTNConfig] and awq[1].bits == 4 and awq[1].group_size == 64
    sq = build_recipe("smoothquant", alpha=0.8)
    assert sq[0] == SmoothQuantConfig(alpha=0.8) and sq[1].act_bits == 8 and sq[1].group_size is None
    assert build_recipe("gptq", group_size=0)[0] == GPTQConfig(bits=4, group_size=None)
    assert build_recipe("gptq", true_sequential=True)[0].true_sequential
    assert build_recipe("rtn", quantize_lm_head=True)[0].ignore == ()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "rtn", "--bits", "4", "--group-size", "48"], "multiple of 32"),
        (["--method", "gptq", "--calib", "/no/such/file"], "does not exist"),
        (["--method", "gptq", "--format", "gptq"], "--symmetric"),
        (["--method", "smoothquant", "--format", "gptq"], "4-bit weight-only"),
        (["--method", "rtn", "--bits", "9"], "bits"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert main(["quantize", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prune_recipes():
    from leanlm.compress import MagnitudeConfig, SparseGPTConfig, WandaConfig
    from leanlm.compress.named_recipes import build_prune_recipe

    assert build_prune_recipe("magnitude") == [MagnitudeConfig(sparsity=0.5)]
    assert build_prune_recipe("magnitude", scope="global")[0].scope == "global"
    assert build_prune_recipe("wanda", pattern="4:8") == [WandaConfig(pattern="4:8")]
    two = build_prune_recipe("sparsegpt", pattern="2:4", then_quantize="gptq", bits=4)
    assert [type(c) for c in two] == [SparseGPTConfig, GPTQConfig] and two[1].group_size == 64
    joint = build_prune_recipe("sparsegpt", sparsity=0.6, joint=True, bits=3, group_size=0)
    assert joint == [SparseGPTConfig(sparsity=0.6, bits=3, group_size=None)]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "wanda", "--joint"], "--method sparsegpt"),
        (["--method", "sparsegpt", "--joint", "--then-quantize", "rtn"], "drop --then-quantize"),
        (["--method", "wanda", "--scope", "global"], "applies to magnitude"),
        (["--method", "magnitude", "--bits", "4"], "--then-quantize"),
        (["--method", "magnitude", "--pattern", "4:2"], "0 < n < m"),
        (["--method", "magnitude", "--sparsity", "1.5"], "fraction"),
        (["--method", "magnitude", "--pattern", "2:4", "--scope", "global"], "local to each group"),
        (["--method", "wanda", "--calib", "/no/such/file"], "does not exist"),
        (["--method", "wanda", "--pattern", "2:4", "--profile", "owl"], "pattern 2:4 fixes it"),
        (["--method", "sparsegpt", "--owl-lambda", "0.05"], "add --profile owl"),
        (["--method", "magnitude", "--profile", "owl", "--scope", "global"], "use scope='layer' with OWL"),
    ],
)
def test_prune_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert main(["prune", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prune_takes_a_fraction_or_a_pattern_not_both(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["prune", "--method", "magnitude", "--sparsity", "0.5", "--pattern", "2:4", "--out", str(tmp_path)])
    assert "not allowed with" in capsys.readouterr().err


def test_prune_command_writes_a_checkpoint_that_loads(tmp_path, capsys, tiny_model, tokenizer):
    from leanlm.formats import save_checkpoint

    source, out = tmp_path / "dense", tmp_path / "pruned"
    save_checkpoint(Checkpoint(tiny_model(), tokenizer), source)
    argv = ["prune", "--model", str(source), "--method", "magnitude", "--pattern", "2:4", "--out", str(out)]
    assert main([*argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "zeros" in printed and "50.0%" in printed
    from leanlm.compress.prune.sparsity import satisfies_nm
    from leanlm.llm import load_model
    from leanlm.model.linear.sparse24 import Sparse24Linear

    down = load_model(str(out), progress=False).model.layers[0].mlp.down_proj
    assert isinstance(down, Sparse24Linear) and satisfies_nm(down.dequantized_weight(), 2, 4)


def test_prune_command_spreads_sparsity_over_layers_with_owl(tmp_path, capsys, tokenizer):
    import torch

    from leanlm.formats import save_checkpoint
    from leanlm.model.llama import build_model
    from tests.conftest import tiny_config, tiny_state_dict

    source, out = tmp_path / "dense", tmp_path / "pruned"
    cfg = tiny_config(tokenizer.vocab_size)  # calibration text tokenized by the tiny tokenizer: ids below its vocab
    save_checkpoint(Checkpoint(build_model(cfg, tiny_state_dict(cfg), torch.float32), tokenizer), source)
    argv = ["prune", "--model", str(source), "--method", "wanda", "--sparsity", "0.5", "--profile", "owl"]
    assert main([*argv, "--owl-lambda", "0.05", "--num-samples", "4", "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "wanda: OWL layer sparsity min 45.00%, OWL layer sparsity max 55.00%" in printed  # two layers: +- lambda


def test_quantize_never_writes_over_its_source_or_another_model(tmp_path, capsys, tiny_model, tokenizer):
    from leanlm.formats import save_checkpoint
    from leanlm.llm import load_model

    source = save_checkpoint(Checkpoint(tiny_model(), tokenizer), tmp_path / "dense")
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    argv = ["quantize", "--model", str(source), "--method", "rtn", "--bits", "8", "--device", "cpu"]
    for out in (source, source / "w8"):  # the source itself, or inside it: refused before anything loads
        assert main([*argv, "--out", str(out), "--overwrite"]) == 2
        assert "which this run reads" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert main([*argv, "--out", str(other)]) == 2
    assert "is not empty" in capsys.readouterr().err and (other / "config.json").read_text() == "{}"
    assert main([*argv, "--out", str(other), "--overwrite"]) == 0
    assert load_model(str(other), progress=False).config.num_hidden_layers == tiny_model().config.num_hidden_layers
