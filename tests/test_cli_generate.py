"""`leanlm generate --best-of N` and `--majority-vote K --answer-regex REGEX`: flag errors before any model load,
and real runs on the bundled SmolLM2."""

from __future__ import annotations

import json

import pytest

from leanlm.cli import main

COUNTING = "Count: 1, 2, 3, 4, 5,"
SMALL = [
    "--dtype",
    "float32",
    "--max-tokens",
    "3",
    "--seed",
    "0",
    "--max-num-seqs",
    "8",
    "--kv-cache-memory-bytes",
    str(32 << 20),
]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--best-of", "3"], "set temperature > 0"),  # the default temperature is 0 (greedy)
        (["--best-of", "0", "--temperature", "0.7"], "--best-of must be an integer >= 1"),
        (["--best-of", "2", "--majority-vote", "2", "--temperature", "0.7"], "not both"),
        (["--majority-vote", "3", "--temperature", "0.7"], "needs --answer-regex"),
        (["--answer-regex", "(x)"], "add --majority-vote"),
        (["--majority-vote", "3", "--answer-regex", "(x", "--temperature", "0.7"], "does not compile"),
    ],
)
def test_selection_flag_errors_come_before_the_model_load(capsys, flags, message):
    assert main(["generate", "hi", "--model", "no-such-model", *flags]) == 2  # the model would fail to load
    assert message in capsys.readouterr().err


@pytest.mark.real_model
def test_majority_vote_prints_the_winner_and_its_support(capsys):
    assert (
        main(
            [
                "generate",
                COUNTING,
                "--majority-vote",
                "6",
                "--answer-regex",
                r"^\s*(\d+)",
                "--temperature",
                "0.7",
                "--json",
                *SMALL,
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["answer"] == "6" and result["num_samples"] == 6
    assert result["votes"] == max(n for _, n in result["counts"]) == result["counts"][0][1]
    assert result["support"] == pytest.approx(result["votes"] / result["num_voting"])

    assert main(["generate", COUNTING, "--best-of", "4", "--temperature", "1.0", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith(COUNTING) and "[best of 4 samples: mean token logprob -" in out


def test_the_timing_line_keeps_prefill_and_kernel_compilation_out_of_the_decode_rate():
    """make demo's first line on a fresh machine read "8 tokens in 3.97 s: 2.0 tokens/s": the compilation and the
    prompt counted as generation. The decode rate comes from the requests' own timestamps."""
    from types import SimpleNamespace

    from leanlm.cli.generate import timing_line

    metrics = SimpleNamespace(first_scheduled_time=10.0, first_token_time=13.5, finished_time=14.2)
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(8)))], metrics=metrics)]
    line = timing_line(outputs, 4.2, compiled=3.3)
    assert line == (
        "8 tokens in 4.20 s (prefill 3.50 s; decode 10.0 tokens/s; 3.30 s of it compiling kernels, once per machine)"
    )
    assert timing_line(outputs, 4.2, compiled=0.0).endswith("decode 10.0 tokens/s)")


def test_generate_says_when_the_engine_preempted(capsys, caplog):
    """A KV pool too small for the batch: the requests finish through preemption, and the command says so."""
    from leanlm.cli import main

    argv = ["generate", "Once upon a time", "The three colors", "--max-tokens", "24", "--dtype", "float32"]
    with caplog.at_level("INFO", logger="leanlm.layout"):  # main's stderr handler, under pytest's log capture
        assert main([*argv, "--num-kv-blocks", "4", "--block-size", "8", "--threads", "1"]) == 0
    assert "preemption(s) by recompute (KV blocks ran out)" in capsys.readouterr().err
    assert "engine: llama, 30 layers, float32 on cpu, 1 thread (fixed); KV cache 4 blocks x 8 tokens" in caplog.text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--regex", "a", "--grammar", "g.lark"], "give one of --json-schema, --regex and --grammar"),
        (["--json-schema", "/no/such/schema.json"], "cannot read /no/such/schema.json"),
        (["--regex", ""], "regex must be a non-empty string"),
    ],
)
def test_structured_output_flag_errors_come_before_the_model_load(capsys, flags, message):
    assert main(["generate", "hi", "--model", "no-such-model", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.real_model
def test_json_schema_and_grammar_flags_constrain_the_output(capsys, tmp_path):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.gbnf").write_text('root ::= "x=" [0-9]')
    args = ["generate", "Is the sky blue?", "--json", *SMALL, "--max-tokens", "32"]  # the last --max-tokens wins
    assert main([*args, "--json-schema", str(tmp_path / "s.json")]) == 0
    assert json.loads(json.loads(capsys.readouterr().out.splitlines()[0])["text"])["answer"] in ("yes", "no")
    assert main([*args, "--grammar", str(tmp_path / "g.gbnf")]) == 0
    text = json.loads(capsys.readouterr().out.splitlines()[0])["text"]
    assert len(text) == 3 and text.startswith("x=") and text[2].isdigit()
