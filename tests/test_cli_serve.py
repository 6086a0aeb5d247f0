"""`leanlm serve`'s router mode: the flags each local replica gets."""

from __future__ import annotations

import pytest

from leanlm.cli.main import build_parser
from leanlm.cli.serve import replica_args
from leanlm.config import ServeConfig


def parse(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def test_replicas_get_the_engine_flags_but_not_the_fronts_own():
    args = parse(
        "--data-parallel-size 2 --port 9000 --host 0.0.0.0 --api-key k --threads 3 --block-size 8 "
        "--no-enable-prefix-caching --max-queue 7 --speculative ngram --dequantize-gguf".split()
    )
    config = ServeConfig(port=9000, host="0.0.0.0", api_key="k", threads=3, max_queue=7, served_model_name="m")
    argv = replica_args(args, config)
    pairs = dict(zip(argv, argv[1:], strict=False))
    assert pairs["--model"] == args.model and pairs["--block-size"] == "8" and pairs["--max-queue"] == "7"
    assert pairs["--speculative"] == "ngram" and pairs["--served-model-name"] == "m"
    assert "--no-enable-prefix-caching" in argv and "--dequantize-gguf" in argv
    for front_only in ("--port", "--host", "--api-key", "--threads", "--data-parallel-size", "--replicas"):
        assert front_only not in argv
    # what a replica is given parses back to the same engine settings
    again = parse([*argv, "--port", "1"])
    assert (again.block_size, again.enable_prefix_caching, again.speculative) == (8, False, "ngram")


def test_router_flags_are_validated_before_anything_starts(capsys):
    from leanlm.cli.main import main

    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--replicas" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--router-policy", "random"])
