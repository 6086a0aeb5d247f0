"""Run `leanlm serve`: the engine loop in the main thread, uvicorn beside it, and a graceful SIGTERM (stop
accepting, let in-flight requests finish up to a timeout, then stop the engine and exit 0)."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading

import uvicorn

from leanlm.config import ServeConfig
from leanlm.engine import AsyncLLMEngine
from leanlm.llm import LLM
from leanlm.server.api import build_app
from leanlm.server.http_config import uvicorn_config

logger = logging.getLogger("leanlm.serve")


def build_server(llm: LLM, model_name: str, config: ServeConfig) -> tuple[uvicorn.Server, AsyncLLMEngine]:
    """The uvicorn server and the engine bridge; the caller runs `engine.run_loop()` (see AsyncLLMEngine)."""
    max_in_flight = llm.llm_engine.engine_config.max_num_seqs + config.max_queue
    per_client = None if config.max_client_share >= 1 else max(1, int(config.max_client_share * max_in_flight))
    engine = AsyncLLMEngine(llm.llm_engine, max_queue=config.max_queue, max_seqs_per_client=per_client)
    app = build_app(
        engine,
        [model_name],
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        start_engine=False,
        metrics_key=config.metrics_key,
        allowed_hosts=config.allowed_host_names,
        enable_docs=config.enable_docs,
        default_max_tokens=config.default_max_tokens,
        chat_control_tokens=config.chat_control_tokens,
        tool_call_parser=config.tool_call_parser,
        max_prompt_chars=config.max_prompt_chars,
        max_pending_prepares=config.max_pending_prepares,
    )
    return uvicorn.Server(uvicorn_config(app, config)), engine


def check_port_free(host: str, port: int) -> None:
    """Raise OSError, saying what to do, when uvicorn could not listen on host:port (taken, or an address this
    machine does not have). Binds and closes a socket as uvicorn would (SO_REUSEADDR: a port whose old
    connections linger in TIME_WAIT is free). Port 0 (any free port) always passes."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            what_to_do = {
                errno.EADDRINUSE: "another program listens there; stop it or pick another --port",
                errno.EACCES: "ports below 1024 need privileges; pick another --port",
            }
            raise OSError(
                f"cannot listen on {host}:{port}: {exc.strerror}; "
                f"{what_to_do.get(exc.errno, 'check --host and --port')}"
            ) from exc


def describe(llm: LLM, model_name: str, config: ServeConfig) -> str:
    engine = llm.llm_engine
    return (
        f"serving {model_name!r} ({llm.model_config.architecture}, {str(llm.dtype).removeprefix('torch.')}) "
        f"on {engine.device}: KV cache {engine.kv_capacity_tokens} tokens in {engine.num_kv_blocks} blocks "
        f"({str(engine.kv_cache_dtype).removeprefix('torch.')}), "
        f"context {engine.max_model_len} tokens, max_num_seqs {engine.engine_config.max_num_seqs}, "
        f"queue {config.max_queue}, auth {'on' if config.api_key else 'off'}, "
        f"at http://{config.host}:{config.port}/v1\n{engine.layout().describe()}"
    )


def serve(llm: LLM, model_name: str, config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM. The engine loop runs here, in the main thread that loaded the model (see
    AsyncLLMEngine on OpenMP), and uvicorn in a second thread. A signal asks uvicorn to stop listening and
    drain in-flight requests (up to shutdown_timeout_s); a second one forces it. uvicorn's shutdown then stops
    the engine loop, and the process exits with status 0. Raises RuntimeError (`leanlm serve` exits 1) if the HTTP
    server could not start, or if the engine loop died (its open requests failed; uvicorn is stopped)."""
    server, engine = build_server(llm, model_name, config)
    failure: list[BaseException] = []

    def run_http() -> None:
        try:
            server.run()
        except BaseException as exc:  # e.g. SystemExit when the port is taken
            failure.append(exc)
        finally:
            engine.request_stop()  # however uvicorn ended, the engine loop must not outlive it

    def on_signal(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if server.should_exit:
            logger.warning("%s again: closing in-flight requests now", name)
            server.force_exit = True
        else:
            logger.info("%s: no new connections; finishing in-flight requests", name)
            server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=run_http, name="leanlm-http")
    died: BaseException | None = None
    try:
        logger.info(describe(llm, model_name, config))
        http.start()
        try:
            engine.run_loop()
        except Exception as exc:  # the engine loop died: a server that only answers 503 must not linger
            died = exc
            logger.error("the engine loop died; stopping the HTTP server")
            server.should_exit = True
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if died is not None:
        raise RuntimeError(f"the engine loop died ({type(died).__name__}: {died}); see the log") from died
    if not server.started:
        raise RuntimeError(f"the HTTP server did not start on {config.host}:{config.port} ({failure or 'see the log'})")
