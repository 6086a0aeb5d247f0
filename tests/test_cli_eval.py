"""`leanlm eval`: flags parse into the eval functions' inputs; bad task names fail before any model load."""

from __future__ import annotations

import pytest

from leanlm.cli import build_parser, cmd_eval_kld, cmd_eval_ppl, cmd_eval_tasks, main


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
