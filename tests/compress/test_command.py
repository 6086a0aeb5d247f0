"""`leanlm quantize`: recipes behind each method, and bad input refused before any model is loaded."""

import pytest

from leanlm.cli import main
from leanlm.cli.quantize import build_recipe
from leanlm.compress import AWQConfig, GPTQConfig, RTNConfig, SmoothQuantConfig


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
