"""Every option and argument of every `leanlm` command has help text (the flags generated from config fields
take theirs from the fields' `help` metadata), and `python -m leanlm` is the console script's entry point."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from leanlm.analysis.estimate_report import EstimateSettings
from leanlm.analysis.load_generator import LoadConfig
from leanlm.cli import build_parser, main
from leanlm.config import DecodingOptions, EngineConfig, LongContextConfig, RouterConfig, ServeConfig

ROOT = Path(__file__).resolve().parents[1]


def walk(parser: argparse.ArgumentParser):
    """(parser, action) for every action of the parser and of all its subparsers, depth first."""
    for action in parser._actions:
        yield parser, action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)


def test_every_option_of_every_command_has_help():
    missing, commands = [], set()
    for parser, action in walk(build_parser()):
        commands.add(parser.prog)
        if isinstance(action, argparse._SubParsersAction):
            # each subcommand's one-line description in the parent's --help
            missing += [f"{parser.prog} {c.dest}" for c in action._choices_actions if not (c.help or "").strip()]
            assert [c.dest for c in action._choices_actions] == list(action.choices)
        elif not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []
    assert {
        "leanlm generate",
        "leanlm chat",
        "leanlm serve",
        "leanlm models",
        "leanlm bench serve",
        "leanlm bench latency",
        "leanlm bench throughput",
        "leanlm estimate",
        "leanlm eval ppl",
        "leanlm eval kld",
        "leanlm eval tasks",
        "leanlm quantize",
    } <= commands


@pytest.mark.parametrize(
    "cls", [EngineConfig, DecodingOptions, LongContextConfig, ServeConfig, RouterConfig, LoadConfig, EstimateSettings]
)
def test_config_fields_carry_their_flag_help(cls):
    # EngineConfig's typed fields: flags of their own
    spelled = {f.name for f in dataclasses.fields(DecodingOptions)} | {"long_context"}
    flags = [f for f in dataclasses.fields(cls) if cls is not EngineConfig or f.name not in spelled]
    assert all(f.metadata.get("help", "").strip() for f in flags), cls.__name__


def test_generated_flags_show_the_field_help_and_default():
    helps = {a.dest: a.help for _, a in walk(build_parser()) if a.dest in ("block_size", "speculative", "port")}
    fields = dataclasses.fields(EngineConfig) + dataclasses.fields(DecodingOptions) + dataclasses.fields(ServeConfig)
    help_of = {f.name: f.metadata["help"] for f in fields if "help" in f.metadata}
    assert helps["block_size"] == help_of["block_size"] + " (default: %(default)s)"
    assert helps["port"] == help_of["port"] + " (default: %(default)s)"
    assert helps["speculative"] == help_of["speculative"]  # default None: nothing to show
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "tokens per KV block (default: 16)" in " ".join(text.split())


def test_python_m_leanlm_is_the_console_script(capsys, monkeypatch):
    """pyproject's script and `python -m leanlm` both run leanlm.cli.main: same help, same output, same status."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"leanlm": "leanlm.cli:main"}
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--help"])
    assert exit.value.code == 0
    in_process = capsys.readouterr().out
    env = {"COLUMNS": "100", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "leanlm", "eval", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout == in_process and in_process.startswith("usage: leanlm eval")
