"""Benchmark peers that live in virtual environments of their own (OpenVINO GenAI, vLLM's CPU build), driven
through a worker script run by that environment's python (leanlm/analysis/peer_workers): one JSON request in,
one JSON line per event out, the model loaded once per batch cap and every repetition run in the same process.

The worker measures each repetition's CPU shares itself (its whole process tree is own, so vLLM's engine
processes are), since only it sees where a repetition starts and ends; this process waits on the pipe meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leanlm.analysis.host import CpuSample
from leanlm.analysis.peers import PEERS_DIR
from leanlm.path_trust import untrusted_reason

WORKERS_DIR = Path(__file__).resolve().parent / "peer_workers"


class PeerWorkerError(RuntimeError):
    """The worker failed or broke the protocol; the message quotes the end of its stderr."""


@dataclass(frozen=True)
class PeerSpec:
    """A peer stack in its own virtual environment, and the worker script that drives it."""

    name: str  # "openvino", "vllm"
    venv: Path  # the environment's root: its python is venv/bin/python
    worker: Path  # the worker script, run by path with that python
    setup_command: str  # what creates the environment (quoted when it is missing)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def is_installed(self) -> bool:
        """Set up, and in an environment no other user could have changed (path_trust): its python and
        packages run as us."""
        return self.python.is_file() and os.access(self.python, os.X_OK) and self.untrusted_reason() is None

    def untrusted_reason(self) -> str | None:
        """Why the environment cannot be trusted (its directory, interpreter or packages), or None."""
        places = [self.venv, self.python, *sorted(self.venv.glob("lib/python*/site-packages"))]
        return next((reason for place in places if (reason := untrusted_reason(place))), None)

    def missing_message(self) -> str:
        if self.python.is_file() and (reason := self.untrusted_reason()):
            return f"refusing the {self.name} environment {self.venv}: {reason}"
        return f"{self.name} is not set up ({self.python} is missing); run `{self.setup_command}`"


OPENVINO = PeerSpec("openvino", PEERS_DIR / "openvino-venv", WORKERS_DIR / "openvino_worker.py", "make peers-openvino")
VLLM = PeerSpec("vllm", PEERS_DIR / "vllm-venv", WORKERS_DIR / "vllm_worker.py", "make peers-vllm")


@dataclass(frozen=True)
class PeerBatch:
    """One batch configuration of a request."""

    max_num_seqs: int  # the peer's cap on requests running together (its engine is built with it)
    num_prompts: int  # the first num_prompts prompts are submitted at once


@dataclass(frozen=True)
class PeerRequest:
    """What a worker runs: greedy generation of exactly output_len tokens per prompt, EOS ignored."""

    model_dir: Path  # what the peer loads: an OpenVINO IR directory, or a dense HF directory for vLLM
    prompts: tuple[tuple[int, ...], ...]  # token ids
    output_len: int  # tokens generated per prompt
    batches: tuple[PeerBatch, ...]  # run in this order, each with a freshly built engine
    reps: int = 2  # timed repetitions per batch
    warmup: bool = True  # one untimed short generation per batch first
    kv_cache_gib: int = 2  # the peer's KV cache, allocated up front
    max_num_batched_tokens: int = 2048  # tokens of one engine step (LeanLM's default budget)
    options: dict = field(default_factory=dict)  # peer-specific, passed through (see each worker's docstring)
    # Each repetition on prompts of its own: consecutive sets of num_prompts, the first for the warm-up (so a
    # prefix cache holds what the sets share, a system prompt, and never a repetition's own prompts).
    distinct_reps: bool = False

    def __post_init__(self) -> None:
        if not self.prompts or not all(self.prompts):
            raise ValueError("PeerRequest needs at least one prompt, and no empty prompt")
        if self.output_len < 1 or self.reps < 1 or self.kv_cache_gib < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("output_len, reps, kv_cache_gib and max_num_batched_tokens must be at least 1")
        sets = self.reps + 1 if self.distinct_reps else 1
        for batch in self.batches:
            if batch.max_num_seqs < 1 or not 1 <= batch.num_prompts * sets <= len(self.prompts):
                raise ValueError(
                    f"{batch}: need max_num_seqs >= 1 and {sets} set(s) of num_prompts >= 1 within the "
                    f"{len(self.prompts)} prompts"
                )

    def to_json(self) -> str:
        data = asdict(self)
        data["model_dir"] = str(self.model_dir)
        return json.dumps(data)


@dataclass(frozen=True)
class PeerRepetition:
    """One timed generation of a batch in the worker."""

    max_num_seqs: int
    num_prompts: int
    rep: int  # 0-based, within its batch
    output_token_ids: tuple[tuple[int, ...], ...]  # per prompt, in prompt order
    wall_s: float  # the generate call alone
    first_token_s: float | None  # call to the first token of any prompt; None where the peer does not say
    cpu: CpuSample  # the worker's process tree is own

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.output_token_ids)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


@dataclass(frozen=True)
class PeerRun:
    """Everything one worker reported."""

    info: dict  # versions and settings, as the worker describes them
    load_s: dict[int, float]  # max_num_seqs -> seconds to build that engine
    repetitions: tuple[PeerRepetition, ...]


def parse_events(lines: list[str], request: PeerRequest) -> PeerRun:
    """The worker's stdout lines -> PeerRun; ValueError on a line that is not an event, on a missing "done",
    or on a repetition that did not make exactly output_len tokens for each of its prompts."""
    info, load_s, reps, done = {}, {}, [], False
    for line in lines:
        try:
            event = json.loads(line)
            kind = event.pop("event")
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
            raise ValueError(f"not a worker event: {line[:200]!r}") from None
        if kind == "info":
            info = event
        elif kind == "loaded":
            load_s[event["max_num_seqs"]] = event["load_s"]
        elif kind == "repetition":
            reps.append(_repetition(event, request.output_len))
        elif kind == "done":
            done = True
    if not done:
        raise ValueError("the worker's output ended without its 'done' event")
    return PeerRun(info, load_s, tuple(reps))


def _repetition(event: dict, output_len: int) -> PeerRepetition:
    tokens = tuple(tuple(t) for t in event["output_token_ids"])
    if len(tokens) != event["num_prompts"] or any(len(t) != output_len for t in tokens):
        raise ValueError(
            f"batch max_num_seqs={event['max_num_seqs']} rep {event['rep']}: asked for {output_len} tokens for "
            f"each of {event['num_prompts']} prompts, got {[len(t) for t in tokens]}"
        )
    cpu = CpuSample(**event["cpu"])
    return PeerRepetition(
        event["max_num_seqs"], event["num_prompts"], event["rep"], tokens, event["wall_s"], event["first_token_s"], cpu
    )


def run_peer(
    spec: PeerSpec,
    request: PeerRequest,
    timeout_s: float = 3600.0,
    on_line: Callable[[str], None] | None = None,
) -> PeerRun:
    """Run the worker of `spec` on `request` and return what it reported. The worker starts a session of its own,
    so a failure or the timeout kills its whole process tree (vLLM's engine processes included).
    on_line sees each stdout line as it comes (progress)."""
    if not spec.is_installed():
        raise PeerWorkerError(spec.missing_message())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # only its own stack
    with tempfile.TemporaryFile("w+b") as stderr:
        process = subprocess.Popen(
            [str(spec.python), str(spec.worker)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
            start_new_session=True,
        )
        timed_out = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (timed_out.set(), _kill_tree(process)))
        timer.start()
        try:
            lines = _exchange(process, request, on_line)
        finally:
            timer.cancel()
            _kill_tree(process)  # leftovers only: a clean worker has stopped its engines already
        stderr.seek(0)
        tail = stderr.read()[-4000:].decode("utf-8", errors="replace")
    if process.returncode != 0:
        how = f"was killed after {timeout_s:.0f} s" if timed_out.is_set() else "exited"
        raise PeerWorkerError(f"{spec.name} worker {how} with status {process.returncode}; its stderr ends:\n{tail}")
    try:
        return parse_events(lines, request)
    except ValueError as e:
        raise PeerWorkerError(f"{spec.name} worker: {e}; its stderr ends:\n{tail}") from None


def _exchange(process: subprocess.Popen, request: PeerRequest, on_line) -> list[str]:
    try:
        process.stdin.write(request.to_json())
        process.stdin.close()
    except BrokenPipeError:
        pass  # it died first: the exit status and stderr tell why
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if on_line is not None:
            on_line(lines[-1])
    process.wait()
    return lines


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the worker's session (the worker and everything it spawned), if any of it is still there."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
