"""EngineConfig holds typed speculative / early-exit configs; the CLI flags and LLM's keyword arguments spell them
as strings, parsed once by EngineConfig.from_options."""

from __future__ import annotations

import dataclasses

import pytest

from leanlm.cli.common import engine_options
from leanlm.cli.main import build_parser
from leanlm.config import EarlyExitConfig, EngineConfig, SpeculativeConfig


def test_the_flags_parse_into_typed_configs():
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--speculative",
            "self:3",
            "--num-speculative-tokens",
            "6",
            "--speculative-max-batch-size",
            "2",
        ]
    )
    config = EngineConfig.from_options(**engine_options(args))
    assert config.speculative == SpeculativeConfig(
        "self", num_draft_layers=3, num_speculative_tokens=6, max_batch_size=2
    )
    assert config.early_exit is None
    args = build_parser().parse_args(["serve", "--early-exit", "16:0.95,24:0.9", "--early-exit-measure", "gap"])
    config = EngineConfig.from_options(**engine_options(args))
    assert config.early_exit == EarlyExitConfig(((16, 0.95), (24, 0.9)), "gap") and config.speculative is None
    assert EngineConfig.from_options(**engine_options(build_parser().parse_args(["chat"]))) == EngineConfig()


def test_typed_configs_pass_through_and_strings_are_refused_by_the_config():
    spec = SpeculativeConfig("ngram", num_speculative_tokens=2)
    assert EngineConfig(speculative=spec).speculative is spec
    assert EngineConfig.from_options(speculative=spec).speculative is spec
    with pytest.raises(TypeError, match=r"takes SpeculativeConfig.*from_options\(speculative=\.\.\.\)"):
        EngineConfig(speculative="ngram")
    with pytest.raises(TypeError, match="takes EarlyExitConfig"):
        EngineConfig(early_exit="2:0.5")
    with pytest.raises(ValueError, match="set num_speculative_tokens and max_batch_size in it"):
        EngineConfig.from_options(speculative=spec, num_speculative_tokens=6)
    with pytest.raises(ValueError, match="set its measure in it"):
        EngineConfig.from_options(early_exit=EarlyExitConfig(((2, 0.5),)), early_exit_measure="gap")
    with pytest.raises(ValueError, match="do not combine"):
        EngineConfig(speculative=spec, early_exit=EarlyExitConfig(((2, 0.5),)))
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['speculation'\]"):
        EngineConfig.from_options(speculation="ngram")


def test_swap_preemption_needs_host_memory():
    with pytest.raises(ValueError, match="swap_space_bytes > 0"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="unknown preemption_mode"):
        EngineConfig(preemption_mode="spill")
    with pytest.raises(ValueError, match="swap_space_bytes must be >= 0"):
        EngineConfig(swap_space_bytes=-1)
    assert not EngineConfig().can_swap and not EngineConfig(preemption_mode="recompute", swap_space_bytes=1).can_swap
    assert EngineConfig(swap_space_bytes=1).can_swap


def test_the_preemption_flags_parse():
    args = build_parser().parse_args(["serve", "--preemption-mode", "swap", "--swap-space-bytes", "4096"])
    config = EngineConfig.from_options(**engine_options(args))
    assert (config.preemption_mode, config.swap_space_bytes, config.can_swap) == ("swap", 4096, True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--preemption-mode", "spill"])


@pytest.mark.parametrize(
    "given,want",
    [(800_000_000, 800_000_000), ("800000000", 800_000_000), ("1.5GB", 1_500_000_000), ("2GiB", 2 << 30)]
    + [("10 MB", 10_000_000), ("64kib", 64 << 10)],
)
def test_max_weight_memory_takes_ints_and_units(given, want):
    assert EngineConfig(max_weight_memory=given).max_weight_memory == want
    args = build_parser().parse_args(["generate", "hi", "--max-weight-memory", str(given)])
    assert EngineConfig.from_options(**engine_options(args)).max_weight_memory == want


@pytest.mark.parametrize("given", ["1.5XB", "GB", "-3", 0, 1.5, True])
def test_a_bad_max_weight_memory_says_how_to_write_one(given):
    with pytest.raises(ValueError, match="max_weight_memory (takes a byte count|must be at least 1 byte)"):
        EngineConfig(max_weight_memory=given)


def test_weight_offloading_refuses_early_exit():
    with pytest.raises(ValueError, match="drop --early-exit or --max-weight-memory"):
        EngineConfig.from_options(max_weight_memory="1GB", early_exit="2:0.9")


def test_every_byte_count_flag_takes_units():
    """`--swap-space-bytes 64MB` was refused while `--max-weight-memory 0.5GB` worked: one parser for all of them,
    on the command line and from LLM(...) alike."""
    from leanlm.cli.main import build_parser
    from leanlm.config import ServeConfig
    from leanlm.config.byte_count import byte_count

    for cls in (EngineConfig, ServeConfig):
        for field in dataclasses.fields(cls):
            if field.name.endswith("_bytes") or field.name.endswith("_memory"):
                assert field.metadata.get("parse") is byte_count, f"{cls.__name__}.{field.name}"
    args = build_parser().parse_args(
        ["serve", "--swap-space-bytes", "64MB", "--kv-cache-memory-bytes", "512MiB", "--max-body-bytes", "1MiB"]
    )
    assert (args.swap_space_bytes, args.kv_cache_memory_bytes, args.max_body_bytes) == (64 * 10**6, 2**29, 2**20)
    config = EngineConfig(swap_space_bytes="64MB", kv_cache_memory_bytes="1GiB")
    assert (config.swap_space_bytes, config.kv_cache_memory_bytes) == (64 * 10**6, 2**30)
    assert EngineConfig(swap_space_bytes="0").swap_space_bytes == 0
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be > 0"):
        EngineConfig(kv_cache_memory_bytes="0")
    with pytest.raises(ValueError, match="byte count like"):
        EngineConfig(swap_space_bytes="lots")
