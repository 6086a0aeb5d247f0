"""Every `leanlm` failure is one line on stderr (`leanlm: error: ...`) and a non-zero status, never a traceback:
real `python -m leanlm` processes for missing, unknown and damaged inputs, a missing optional package, a taken
port and Ctrl-C; in process, the mapping itself and LEANLM_DEBUG."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from leanlm import cli
from leanlm.cli import models as models_command
from leanlm.loading.errors import ModelLoadError
from tests.test_cli_bench import word_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]


def leanlm_env(**extra: str) -> dict[str, str]:
    """The worktree's leanlm first on the path (not another install's), no debug switch."""
    env = {k: v for k, v in os.environ.items() if k != "LEANLM_DEBUG"}
    path = [str(ROOT), *extra.pop("PYTHONPATH", "").split(os.pathsep)]
    return env | {"PYTHONPATH": os.pathsep.join(p for p in path if p)} | extra


def run_leanlm(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "leanlm", *argv],
        cwd=ROOT,
        env=leanlm_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "damaged.gguf").write_bytes(b"GGUF" + bytes(60))  # the magic, then nothing a header needs
    (root / "not-a-model.gguf").write_text("plain text")
    no_matplotlib = root / "no-matplotlib"
    no_matplotlib.mkdir()
    # Python imports sitecustomize at start-up: this hides an installed matplotlib as if it were absent.
    (no_matplotlib / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    return root


# (argv, env, exit status, a piece of the one line): real processes, since a process is what a user runs.
# Each fails before any model loads, in about 2 s (importing torch), so only these few; IN_PROCESS has more.
CASES = {
    "missing model file": (["generate", "hi", "--model", "{root}/absent.gguf"], {}, 2, "does not exist"),
    "damaged model file": (
        ["generate", "hi", "--model", "{root}/damaged.gguf"],
        {},
        2,
        "damaged.gguf has a corrupt or truncated header",
    ),
    "bad flag value": (["generate", "hi", "--max-tokens", "lots"], {}, 2, "invalid int value: 'lots'"),
    "missing optional package": (
        ["estimate", "--model", "llama-7b", "--plot", "{root}/roofline.png"],
        {"PYTHONPATH": "{root}/no-matplotlib"},
        1,
        "optional package 'matplotlib', which is not installed: pip install matplotlib",
    ),
}
# The same promise through main(argv), for more kinds of input.
IN_PROCESS = {
    "unknown model name": (["generate", "hi", "--model", "no-such-model"], 2, "unknown model 'no-such-model'"),
    "not a model file": (["generate", "hi", "--model", "{root}/not-a-model.gguf"], 2, "neither a GGUF file"),
    "value a config refuses": (["serve", "--max-queue", "-1"], 2, "max_queue must be >= 0"),
    # an unknown model would fail with its own message: the data file is checked before the model loads
    "missing data file": (
        ["eval", "ppl", "--data", "{root}/absent.txt", "--model", "no-such-model"],
        2,
        "absent.txt does not exist",
    ),
    "missing bench data": (
        ["bench", "latency", "--data", "{root}/absent.txt", "--model", "no-such-model"],
        2,
        "prompt data file {root}/absent.txt does not exist",
    ),
    "missing required flag": (["quantize", "--out", "{root}/out"], 2, "the following arguments are required: --method"),
    "pull without a name": (["models", "pull"], 2, "needs a NAME"),
}


def assert_one_line(stderr: str, piece: str) -> None:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leanlm: error: "), stderr
    assert piece in lines[0]


@pytest.fixture(scope="module")
def failures(files) -> dict[str, subprocess.CompletedProcess]:
    def run(case):
        argv, env, _, _ = CASES[case]
        fill = lambda s: s.format(root=files)  # noqa: E731
        return case, run_leanlm([fill(a) for a in argv], **{k: fill(v) for k, v in env.items()})

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, CASES))


@pytest.mark.parametrize("case", CASES)
def test_a_failure_is_one_line_and_a_status(failures, case):
    result, (_, _, status, piece) = failures[case], CASES[case]
    assert_one_line(result.stderr, piece)
    assert result.returncode == status


@pytest.mark.parametrize("case", IN_PROCESS)
def test_a_failure_in_process_is_one_line_and_a_status(files, case, capsys):
    argv, status, piece = IN_PROCESS[case]
    try:
        code = cli.main([a.format(root=files) for a in argv])
    except SystemExit as exit:  # argparse's usage errors exit from parse_args
        code = exit.code
    assert code == status
    assert_one_line(capsys.readouterr().err, piece.format(root=files))


def test_a_taken_port_fails_before_the_model_loads(files):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # An unknown model would fail with status 2 at the load: the port check comes first.
        result = run_leanlm(["serve", "--port", str(port), "--model", "no-such-model"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"leanlm: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "another program listens there; stop it or pick another --port"
    )


def _first_http_request(listener: socket.socket) -> socket.socket:
    """The first accepted connection that sends an HTTP request line. A connection that sends nothing (a
    stray client of an earlier test that had this port) is dropped: interrupting on it would signal the
    child before it runs any code of ours."""
    while True:
        connection, _ = listener.accept()
        connection.settimeout(30)
        try:
            head = connection.recv(16)
        except TimeoutError:
            head = b""
        if head.startswith((b"GET ", b"POST ")):
            return connection
        connection.close()


def test_ctrl_c_exits_130_quietly(tmp_path):
    """SIGINT while `bench serve` waits on a server that accepted the connection and never answers."""
    tokenizer = word_tokenizer_dir(tmp_path / "tokenizer")
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox " * 50)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        argv = [
            "bench",
            "serve",
            "--url",
            f"http://127.0.0.1:{silent.getsockname()[1]}",
            "--num-requests",
            "1",
            "--input-len",
            "4",
            "--data",
            str(data),
            "--tokenizer",
            str(tokenizer),
            "--no-progress",
        ]
        proc = subprocess.Popen(
            [sys.executable, "-m", "leanlm", *argv],
            cwd=ROOT,
            env=leanlm_env(PYTHONFAULTHANDLER="1"),  # SIGABRT then prints every thread's stack
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            connection = _first_http_request(silent)  # the child's request is in flight
            with connection:
                proc.send_signal(signal.SIGINT)
                try:
                    _, stderr = proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGABRT)
                    _, stacks = proc.communicate(timeout=30)
                    pytest.fail(f"still running 60 s after SIGINT; its threads:\n{stacks[-6000:]}")
        finally:
            proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_missing_peer_package_fails_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    status = cli.main(["bench", "latency", "--compare", "hf", "--model", "no-such-model"])
    assert status == 1
    assert capsys.readouterr().err == (
        "leanlm: error: this needs the optional package 'transformers', which is not "
        "installed: pip install 'leanlm[peers]'\n"
    )


@pytest.mark.parametrize(
    "exc, line, status",
    [
        (ModelLoadError("unknown model 'x'"), "unknown model 'x'", 2),
        (FileNotFoundError(2, "No such file or directory", "/a/b.txt"), "/a/b.txt: No such file or directory", 2),
        (ConnectionError("cannot reach http://h:1"), "cannot reach http://h:1", 1),
        (
            RuntimeError("compiling x.c failed:\ncc: error\nline 2"),
            "compiling x.c failed: [2 more lines: LEANLM_DEBUG=1 shows them]",
            1,
        ),
        (KeyError("k"), "internal error, KeyError: 'k' (LEANLM_DEBUG=1 shows the traceback)", 1),
        (
            ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp"),
            "this needs the optional package 'llama_cpp', which is not installed: pip install 'leanlm[peers]' "
            "(llama-cpp-python: it compiles llama.cpp, minutes)",
            1,
        ),
        (
            ModuleNotFoundError("No module named 'leanlm.nope'", name="leanlm.nope"),
            "internal error, ModuleNotFoundError: No module named 'leanlm.nope' (LEANLM_DEBUG=1 shows the traceback)",
            1,
        ),
    ],
)
def test_failure_message(exc, line, status):
    assert cli.failure_message(exc) == (line, status)


def raising(exc: BaseException):
    def command(args):
        raise exc

    return command


def test_interrupt_is_quiet_and_debug_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.delenv("LEANLM_DEBUG", raising=False)
    monkeypatch.setattr(models_command, "cmd_models", raising(KeyboardInterrupt()))
    assert cli.main(["models"]) == 130
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(models_command, "cmd_models", raising(KeyError("k")))
    assert cli.main(["models"]) == 1
    monkeypatch.setenv("LEANLM_DEBUG", "1")
    with pytest.raises(KeyError):
        cli.main(["models"])
    monkeypatch.setattr(models_command, "cmd_models", raising(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        cli.main(["models"])
