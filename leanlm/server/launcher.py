"""Start `leanlm serve`: load the model, build the app, and run uvicorn with a graceful SIGTERM (stop
accepting, let in-flight requests finish up to a timeout, then stop the engine and exit)."""

from __future__ import annotations

import logging
import signal
import uvicorn

from leanlm.engine.async_engine import AsyncLLMEngine
from leanlm.llm import LLM
from leanlm.config import ServeConfig
from leanlm.server.api import build_app

logger = logging.getLogger("leanlm.serve")


def build_server(llm: LLM, model_name: str, config: ServeConfig) -> uvicorn.Server:
    engine = AsyncLLMEngine(llm.llm_engine, max_queue=config.max_queue)
    app = build_app(engine, [model_name], api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=config.shutdown_timeout_s, access_log=False,
    )
    return uvicorn.Server(uv_config)


def describe(llm: LLM, model_name: str, config: ServeConfig) -> str:
    engine = llm.llm_engine
    return (
        f"serving {model_name!r} ({llm.model_config.architecture}, {str(llm.dtype).removeprefix('torch.')}) "
        f"on {engine.device}: KV cache {engine.kv_capacity_tokens} tokens in {engine.num_kv_blocks} blocks, "
        f"context {engine.max_model_len} tokens, max_num_seqs {engine.engine_config.max_num_seqs}, "
        f"queue {config.max_queue}, auth {'on' if config.api_key else 'off'}, "
        f"at http://{config.host}:{config.port}/v1"
    )


def serve(llm: LLM, model_name: str, config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM. uvicorn handles the signal (stop listening, drain in-flight requests up to
    the timeout, then the app's shutdown stops the engine) and re-raises it once done; the handlers set here
    make that re-raise a clean exit (status 0) instead of a kill or a KeyboardInterrupt traceback."""
    server = build_server(llm, model_name, config)
    logger.info(describe(llm, model_name, config))

    def after_drain(signum: int, frame) -> None:
        logger.info("stopped by %s after draining", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, after_drain) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
