"""Server processes for the serving benchmark: llama.cpp's own `llama-server` (parallel slots, continuous
batching) and `leanlm serve`, each started, health-checked and stopped the same way.

Why not `python -m llama_cpp.server` (llama-cpp-python 0.3.36, installed in the venv)? Its FastAPI app runs
every request under one global lock (`llama_outer_lock`/`llama_inner_lock` in llama_cpp/server/app.py), so
requests are served one at a time; with its default `interrupt_requests=True` a new request even *cuts off*
the one streaming (4 concurrent requests for 32 tokens: three ended after 1 token). It also ignores
`stream_options.include_usage`. That measures a queue, not a batching server.

How the binary was obtained (only the PyPI sdist is downloaded; nothing is committed to this repository):
llama-cpp-python's sdist vendors the full llama.cpp source under `vendor/llama.cpp` (for 0.3.36: llama.cpp
commit 0c1e570, "webgpu: fix SSM_SCAN binding aliasing"). `benchmarks/build_llama_server.sh` (`make
llama-server`) unpacks the sdist of the installed version (`pip download --no-deps --no-binary :all:
llama-cpp-python==VERSION`) into `<peers>/llama.cpp`, where `<peers>` is the `peers/` directory beside the
checkout (here /work/peers), and builds the server there, with llama.cpp linked in statically, for this CPU:
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \\
          -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \\
          -DLLAMA_USE_PREBUILT_UI=OFF  # the web UI is not needed (its assets would be downloaded)
    cmake --build build --target llama-server -j2
giving `<peers>/llama.cpp/build/bin/llama-server`. A `llama-server` on PATH is used when that is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from leanlm.path_trust import untrusted_reason

PEERS_DIR = Path(__file__).resolve().parents[3] / "peers"  # beside the checkout: never inside the repository
BUILT_LLAMA_SERVER = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server"


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (no binary, or it would not start); the message says what to do."""


def find_llama_server() -> Path | None:
    """The llama-server we built under PEERS_DIR, else one on PATH, else None. PeerUnavailable when the built
    one is there but another user could have replaced it (path_trust): running it would run their code."""
    if BUILT_LLAMA_SERVER.is_file() and os.access(BUILT_LLAMA_SERVER, os.X_OK):
        if reason := untrusted_reason(BUILT_LLAMA_SERVER):
            raise PeerUnavailable(f"refusing to run {BUILT_LLAMA_SERVER}: {reason}")
        return BUILT_LLAMA_SERVER
    found = shutil.which("llama-server")
    return Path(found) if found else None


@dataclass(frozen=True)
class LlamaServerConfig:
    """How to run llama-server for one benchmark."""

    model_path: Path  # the GGUF file (the same one our engine loads)
    parallel: int = 8  # slots: requests decoded together by continuous batching
    ctx_per_slot: int = 1024  # tokens of context each slot holds (prompt + output must fit)
    threads: int = os.cpu_count() or 1  # for decode and for prompt processing
    port: int = 8081
    host: str = "127.0.0.1"
    binary: Path | None = None  # None: find_llama_server()
    extra_args: tuple[str, ...] = ()  # appended verbatim, e.g. ("--cache-ram", "0")
    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("parallel", "ctx_per_slot", "threads", "port"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaServerConfig.{name} must be at least 1, got {getattr(self, name)}")
        if not Path(self.model_path).is_file():
            raise ValueError(f"GGUF file {self.model_path} does not exist; pass the model file llama.cpp should load")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, binary: Path) -> list[str]:
        # --ctx-size is the whole KV cache; without a unified cache each of the `parallel` slots gets an equal
        # share, so ctx_per_slot is exactly what one request may use.
        return [
            str(binary),
            "--model",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--parallel",
            str(self.parallel),
            "--ctx-size",
            str(self.parallel * self.ctx_per_slot),
            "--no-kv-unified",
            "--cont-batching",
            "--threads",
            str(self.threads),
            "--threads-batch",
            str(self.threads),
            "--no-webui",
            *self.extra_args,
        ]


class ServerProcess:
    """A server subprocess: `with ServerProcess(name, command, url) as server:` starts it, waits until GET
    /health answers 200, and stops it (SIGTERM, then SIGKILL after 10 s)."""

    def __init__(self, name: str, command: list[str] | None, url: str, startup_timeout_s: float = 120.0) -> None:
        self.name = name
        self.command = command  # the command line it runs (subclasses may fill it in start())
        self.url = url
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None  # the server's stdout and stderr, while it runs

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> ServerProcess:
        with tempfile.NamedTemporaryFile("wb", prefix=f"{self.name}-", suffix=".log", delete=False) as log:
            self.log_path = Path(log.name)
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_healthy(self) -> None:
        """Poll GET /health until it answers 200 (servers answer 503 or refuse while the model loads)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerUnavailable(
                    f"{self.name} exited with status {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise PeerUnavailable(
            f"{self.name} did not become healthy within {self.startup_timeout_s} s:\n{self.log_tail()}"
        )

    def log_tail(self, num_bytes: int = 3000) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_bytes()[-num_bytes:].decode("utf-8", errors="replace")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; then the log goes (a failed start already quoted its tail)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LlamaServer(ServerProcess):
    """llama.cpp's llama-server for one benchmark: `with LlamaServer(cfg) as server: ... server.url ...`."""

    def __init__(self, config: LlamaServerConfig) -> None:
        super().__init__("llama-server", None, config.url, config.startup_timeout_s)
        self.config = config

    def start(self) -> LlamaServer:
        binary = self.config.binary or find_llama_server()
        if binary is None:
            raise PeerUnavailable(
                f"llama.cpp's llama-server is not built ({BUILT_LLAMA_SERVER} is missing and none "
                "is on PATH); build it with benchmarks/build_llama_server.sh"
            )
        if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
            raise PeerUnavailable(f"{binary} is not executable; point LlamaServerConfig.binary at a llama-server build")
        self.command = self.config.command(Path(binary))
        return super().start()


def leanlm_server(model: str, port: int, extra_args: tuple[str, ...] = (), host: str = "127.0.0.1") -> ServerProcess:
    """`leanlm serve` in its own process, as users run it (from this interpreter's environment)."""
    command = [
        sys.executable,
        "-m",
        "leanlm.cli",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra_args,
    ]
    return ServerProcess("leanlm-serve", command, f"http://{host}:{port}")
