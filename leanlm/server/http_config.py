"""uvicorn's settings for a leanlm HTTP process (`leanlm serve` and the fleet's front): connection limits checked
against the open-file limit, the guarded h11 protocol, and X-Forwarded-For only from named proxies."""

from __future__ import annotations

import uvicorn

from leanlm.config import ServeConfig
from leanlm.server.connections import ConnectionLimits, connection_limits, guarded_protocol


def serve_limits(config: ServeConfig) -> ConnectionLimits:
    """The connection limits `config` asks for, checked against the open-file limit (a ValueError otherwise)."""
    return connection_limits(
        config.max_connections, config.reserved_connections, config.header_timeout_s, config.body_timeout_s
    )


def uvicorn_config(app, config: ServeConfig) -> uvicorn.Config:
    """uvicorn's settings for `app`. X-Forwarded-For is read only from the proxies the config names: uvicorn
    trusts it from loopback by default, which would let any local client pick the address the per-client
    limit counts against. Connections go through the guarded h11 protocol (leanlm/server/connections.py), not
    uvicorn's limit_concurrency: that one answers 503 to /health too once the limit is reached, and never closes
    a connection that sends nothing."""
    proxies = config.trusted_proxy_ips
    limits = serve_limits(config)
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=config.shutdown_timeout_s,
        timeout_keep_alive=config.keep_alive_timeout_s,
        http=guarded_protocol(limits),
        backlog=limits.backlog,
        access_log=False,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=list(proxies) if proxies else None,
    )
