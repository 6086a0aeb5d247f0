"""`leanlm serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time

from leanlm.cli.common import (
    add_dataclass_args,
    add_model_args,
    load_llm,
)
from leanlm.config import ServeConfig


def cmd_serve(args: argparse.Namespace) -> int:
    from leanlm.server.launcher import check_port_free, serve

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)}
    if options["api_key"] is None:
        options["api_key"] = os.environ.get("LEANLM_API_KEY") or None
    if options["metrics_key"] is None:
        options["metrics_key"] = os.environ.get("LEANLM_METRICS_KEY") or None
    config = ServeConfig(**options)  # validate before the (slow) model load
    check_port_free(config.host, config.port)  # likewise: a taken port fails in a second, not after the load
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    started = time.perf_counter()
    llm = load_llm(args)
    logging.getLogger("leanlm.serve").info(
        "model %s loaded in %.2f s (%s, %s)", args.model, time.perf_counter() - started, llm.dtype, llm.device
    )
    serve(llm, config.served_model_name or args.model, config)  # RuntimeError (exit 1) if it could not start
    return 0


def add_parser(sub) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    add_model_args(srv)
    add_dataclass_args(srv, ServeConfig)
    srv.set_defaults(func=cmd_serve)
