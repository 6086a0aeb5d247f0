"""The docs name only code that exists: every backticked module, file, class, function, attribute or `leanlm`
flag in docs/*.md and the README must still be found in the repository (a rename that forgets the docs fails
here)."""

from __future__ import annotations

import argparse
import ast
import re
from functools import cache
from pathlib import Path

import pytest

from leanlm.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCES = ("leanlm", "benchmarks", "tests")
# Names of other projects that docs cite as such (their modules, classes and functions), never ours.
FOREIGN_ROOTS = {
    "torch", "F", "nn", "np", "numpy", "transformers", "vllm", "llama_cpp", "llm", "openvino", "openvino_genai",
    "optimum", "ov", "ov_genai", "openai", "uvicorn", "fastapi", "safetensors", "gguf", "prometheus_client",
    "accelerate", "os", "sys", "json", "pip", "gensim", "olmo_eval", "tqdm", "ctypes", "pytest", "torchao",
    "llmcompressor", "compressed_tensors", "auto_gptq", "gptqmodel", "sglang", "tokenizers", "jinja2", "math",
}  # fmt: skip
FOREIGN_NAMES = {"TorchCpuAvx512Linear"}  # gptqmodel's CPU layer, named where transformers loads our export
CODE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\(\))?$")
SOURCE_PATH = re.compile(r"^[\w./-]+\.(py|c|h)$")
PLACEHOLDER = re.compile(r"(?<![A-Za-z0-9])(NAME|COMMAND|MODEL|DIR|OUT|PATH|FILE)(?![A-Za-z0-9])")
COMMAND = re.compile(r"^leanlm ([a-z]+)\b(.*)$")


def _spans(text: str) -> list[str]:
    """Backticked spans outside fenced code blocks (those are examples, often of other tools)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


@cache
def _source_files() -> list[Path]:
    files = [p for root in SOURCES for p in (ROOT / root).rglob("*") if p.suffix in (".py", ".c", ".h")]
    return [p for p in files if "__pycache__" not in p.parts and p != Path(__file__).resolve()]


@cache
def _identifiers() -> frozenset[str]:
    """Every identifier token in our sources, in code or in strings (HF weight names, JSON keys and flags
    written as strings count: the docs may name them)."""
    names: set[str] = set()
    for path in _source_files():
        text = path.read_text(errors="replace")
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", (ROOT / "Makefile").read_text()))
    names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", (ROOT / "pyproject.toml").read_text()))
    return frozenset(names)


@cache
def _class_members() -> dict[str, frozenset[str]]:
    """Class name -> the names defined on it (methods, class attributes, dataclass fields, self.X assignments),
    merged over every class of that name in the package."""
    members: dict[str, set[str]] = {}
    for path in (ROOT / "leanlm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = members.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.attr)
    return {k: frozenset(v) for k, v in members.items()}


@cache
def _module_names() -> frozenset[str]:
    """Dotted names of our modules and packages: leanlm.model.llama, leanlm.model, ..."""
    names = set()
    for path in (ROOT / "leanlm").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.add(".".join(parts))
    return frozenset(names)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub[0].choices) if sub else {}


def _flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(s for action in parser._actions for s in action.option_strings)


@cache
def _all_flags() -> frozenset[str]:
    found, todo = set(), [build_parser()]
    while todo:
        parser = todo.pop()
        found |= _flags(parser)
        todo.extend(_subcommands(parser).values())
    return frozenset(found)


def _path_exists(span: str) -> bool:
    """A file named by its repository path, its package path (model/llama.py) or its bare name."""
    if (ROOT / span).exists() or (ROOT / "leanlm" / span).exists():
        return True
    return any(p.as_posix().endswith("/" + span.lstrip("./")) for p in _source_files())


def _code_name_problem(span: str) -> str | None:
    name = span.removesuffix("()")
    parts = name.split(".")
    if parts[0] in FOREIGN_ROOTS or name in FOREIGN_NAMES:
        return None
    if len(parts) == 1 and (len(name) < 4 or ("_" not in name.strip("_") and not _is_camel(name))):
        return None  # a plain word or a suffix in backticks (`auto`, `none`, `_s`)
    if parts[0] == "leanlm":
        module = next(
            (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in _module_names()), None
        )
        if module is None:
            return f"no module {name}"
        rest = parts[len(module.split(".")) :]
        return None if all(p in _identifiers() for p in rest) else f"{name}: {module} defines no {'.'.join(rest)}"
    if len(parts) == 2 and parts[0] in _class_members() and parts[1] not in _class_members()[parts[0]]:
        return f"class {parts[0]} has no member {parts[1]}"
    missing = [p for p in parts if p not in _identifiers() and p not in ("py", "md")]
    return f"{name}: no {', '.join(missing)} in the sources" if missing else None


def _is_camel(word: str) -> bool:
    return bool(re.match(r"^[A-Z][a-z0-9]+[A-Z]\w*$", word))


def _command_problem(span: str) -> str | None:
    command, rest = COMMAND.match(span).groups()
    parser = _subcommands(build_parser()).get(command)
    if parser is None:
        return f"no command `leanlm {command}`"
    words = rest.split()
    while words and words[0] in _subcommands(parser):  # `leanlm bench latency ...`, `leanlm eval ppl ...`
        parser = _subcommands(parser)[words.pop(0)]
    unknown = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)) - _flags(parser))
    return f"`{parser.prog}` has no {', '.join(unknown)}" if unknown else None


def _flag_problem(span: str) -> str | None:
    flag = re.match(r"--[a-z][a-z0-9-]*", span).group(0)
    return None if flag in _all_flags() or flag in _identifiers_as_flags() else f"no command takes {flag}"


@cache
def _identifiers_as_flags() -> frozenset[str]:
    """Flags of other programs that our sources pass (llama-server's, pip's, ...): written there as strings."""
    flags = set()
    for path in _source_files():
        flags.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", path.read_text(errors="replace")))
    flags.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", (ROOT / "Makefile").read_text()))
    return frozenset(flags)


def problems(text: str, where: str) -> list[str]:
    """One line per backticked name in `text` (a markdown file's) that the repository no longer has."""
    found = []
    for span in _spans(text):
        span = span.strip()
        if COMMAND.match(span):
            problem = _command_problem(span)
        elif span.startswith("--"):
            problem = _flag_problem(span)
        elif PLACEHOLDER.search(span):
            problem = None  # a template (`leanlm/cli/NAME.py`, `leanlm COMMAND --help`), not a name
        elif SOURCE_PATH.match(span):
            problem = None if _path_exists(span) else f"no file {span}"
        elif CODE_NAME.match(span):
            problem = _code_name_problem(span)
        else:
            problem = None  # an expression, a shell line of another tool, a value
        if problem:
            found.append(f"{where}: `{span}`: {problem}")
    return found


def _fenced_commands(text: str) -> list[str]:
    """`leanlm ...` command lines inside fenced code blocks (a `$ ` prompt and backslash continuations joined):
    the commands a reader copies, each checked against its own (sub)command's parser."""
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ").split("  #")[0]
            if COMMAND.match(line):
                commands.append(line)
    return commands


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_documented_command_lines_take_only_their_own_flags(path):
    """Not "the flag exists somewhere": each command line in a code block names only flags of that command."""
    lines = _fenced_commands(path.read_text())
    found = [f"{line}: {problem}" for line in lines if (problem := _command_problem(line))]
    # bash passes "a\nb" as a backslash and an n: a newline in a prompt needs $'a\nb'
    found += [f"{line}: a literal \\n in double quotes" for line in lines if re.search(r'"[^"]*\\n[^"]*"', line)]
    assert not found, "\n".join(found)


def test_the_command_line_checker_reads_code_blocks():
    text = "```bash\n$ leanlm bench --tensor-parallel-size 2 \\\n    --model m\nleanlm generate --prompt x  # no\n```\n"
    lines = _fenced_commands(text)
    assert lines == ["leanlm bench --tensor-parallel-size 2 --model m", "leanlm generate --prompt x"]
    assert "`leanlm bench` has no --model, --tensor-parallel-size" == _command_problem(lines[0])
    assert "has no --prompt" in _command_problem(lines[1])
    assert _command_problem("leanlm bench latency --tensor-parallel-size 2 --max-weight-memory 1GB") is None


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_name_only_code_that_exists(path):
    found = problems(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_checker_catches_stale_names():
    text = (
        "Call `bind_kv_cache` and `ModelRunner.kv_scales`, see `leanlm/quant.py`, `leanlm.engine.nothing_here`, "
        "`leanlm generate --no-such-flag`, `--gone-flag` and `KIND_BF16`.\n```\n`not_checked_in_fences`\n```\n"
    )
    found = problems(text, "stale.md")
    assert len(found) == 7, found
    fresh = "See `leanlm/model/llama.py`, `LLMEngine.step`, `leanlm generate --max-tokens 8` and `q_proj`."
    assert problems(fresh, "fresh.md") == []


def test_the_readme_lists_every_estimate_preset():
    from leanlm.analysis.model_shape import PRESETS

    readme = " ".join((ROOT / "README.md").read_text().split())
    missing = [name for name in PRESETS if f" {name}," not in readme and f" {name})" not in readme]
    assert not missing, f"README's preset list lacks {missing}"
