"""`leanlm generate` on a prompt the model's tokenizer panics on (issue 47 item 6): one error line and status 2, as
for every other bad input; before, pyo3's PanicException (a BaseException) passed the CLI's handler as a traceback."""

from __future__ import annotations

from leanlm import cli
from leanlm.formats.hf_dir import save_hf_dir
from tests.conftest import tiny_config, tiny_state_dict
from tests.loading.test_tokenizer import RUNTIME_PANIC_PATTERN, RUNTIME_PANIC_TEXT, panicking_tokenizer_json
from tests.tiny_tokenizer import tiny_tokenizer


def test_generate_on_a_prompt_the_tokenizer_panics_on_is_one_line(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    config = tiny_config(tokenizer.vocab_size)
    save_hf_dir(tmp_path, config, tiny_state_dict(config))
    tokenizer.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text(panicking_tokenizer_json(RUNTIME_PANIC_PATTERN))
    argv = ["generate", "--model", str(tmp_path), "--max-tokens", "2", "--dtype", "float32"]
    assert cli.main([*argv, "ab ab"]) == 0  # the model runs: only the prompt the regex backtracks on fails
    capsys.readouterr()
    assert cli.main([*argv, RUNTIME_PANIC_TEXT]) == 2
    err = capsys.readouterr().err  # the loading progress bars, then the error
    assert "Traceback" not in err and "PanicException" not in err
    errors = [line for line in err.splitlines() if line.startswith("leanlm: error: ")]
    assert len(errors) == 1 and errors[0].startswith("leanlm: error: the tokenizer failed on this text"), err
    assert err.strip().splitlines()[-1] == errors[0]
