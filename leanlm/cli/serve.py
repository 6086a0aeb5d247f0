"""`leanlm serve`: the OpenAI-compatible HTTP server, or (--data-parallel-size N, --replicas) a routing front over
engine replicas (leanlm/fleet/front.py)."""

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
from leanlm.config import RouterConfig, ServeConfig
from leanlm.config.engine import option_names

# ServeConfig fields the front keeps for itself: each local replica listens on loopback with a key of its own.
FRONT_ONLY = frozenset({"host", "port", "api_key", "metrics_key", "allowed_hosts", "forwarded_allow_ips", "threads"})


def cmd_serve(args: argparse.Namespace) -> int:
    from leanlm.server.http_config import serve_limits
    from leanlm.server.launcher import check_port_free, serve

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig) if f.name != "threads"}
    options["threads"] = args.num_threads  # one --threads flag: the engine's (each replica's, behind a front)
    if options["api_key"] is None:
        options["api_key"] = os.environ.get("LEANLM_API_KEY") or None
    if options["metrics_key"] is None:
        options["metrics_key"] = os.environ.get("LEANLM_METRICS_KEY") or None
    config = ServeConfig(**options)  # validate before the (slow) model load
    router_config = RouterConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)})
    check_port_free(config.host, config.port)  # likewise: a taken port fails in a second, not after the load
    serve_limits(config)  # and connection limits the open-file limit cannot hold
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    modules = parse_lora_modules(args.lora_modules)  # name=path pairs, checked before the model loads
    if modules:
        args.enable_lora = True
    if router_config.is_routed:
        if modules:
            raise ValueError("--lora-modules serves adapters from one engine; drop --data-parallel-size / --replicas")
        return serve_front(args, config, router_config)
    started = time.perf_counter()
    llm = load_llm(args)
    for name, path in modules.items():  # read and check each adapter now: a bad one fails the start, not a request
        llm.llm_engine.prepare_lora(llm.llm_engine.lora_manager.register(name, path))
    logging.getLogger("leanlm.serve").info(
        "model %s loaded in %.2f s (%s, %s)", args.model, time.perf_counter() - started, llm.dtype, llm.device
    )
    serve(llm, config.served_model_name or args.model, config)  # RuntimeError (exit 1) if it could not start
    return 0


def serve_front(args: argparse.Namespace, config: ServeConfig, router_config: RouterConfig) -> int:
    from leanlm.fleet.front import serve_routed
    from leanlm.formats.stored import load_tokenizer

    tokenizer = load_tokenizer(args.model)  # the front tokenizes prompts for prefix affinity; no weights
    if not config.served_model_name:  # every replica answers to the name the user would see without a front
        config = dataclasses.replace(config, served_model_name=args.model)
    serve_routed(replica_args(args, config), tokenizer, args.block_size, config, router_config)
    return 0


def replica_args(args: argparse.Namespace, config: ServeConfig) -> list[str]:
    """The flags each local replica gets: the model and engine flags as given, the ServeConfig flags but the
    front's own (FRONT_ONLY); the front adds host, port, threads and the key."""
    names = ["model", "dtype", "device", "dequantize_gguf"]
    names += sorted(option_names() - {"num_threads"})  # the front gives each replica its --threads
    values = {name: getattr(args, name) for name in names}
    values |= {f.name: getattr(config, f.name) for f in dataclasses.fields(ServeConfig) if f.name not in FRONT_ONLY}
    argv: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            if name == "dequantize_gguf":  # a store_true flag: no --no- form
                argv += [flag] if value else []
            else:
                argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def add_parser(sub) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    add_model_args(srv)
    add_dataclass_args(srv, ServeConfig, exclude=("threads",))  # EngineConfig's --threads sets it
    add_dataclass_args(srv, RouterConfig)
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) requests select with model: NAME or BASE:NAME; implies --enable-lora "
        "(see --max-loras, --max-lora-rank)",
    )
    srv.set_defaults(func=cmd_serve)


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as {name: path}; ValueError for a malformed or repeated name."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or ":" in name:
            raise ValueError(f"--lora-modules takes NAME=PATH (no ':' in NAME), got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules
