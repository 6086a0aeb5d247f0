"""RouterConfig: data-parallel replicas of `leanlm serve` behind one cache-aware front; each field is a flag."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

ROUTER_POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class RouterConfig:
    """How `leanlm serve` splits work over engine processes. With data_parallel_size 1 and no replicas it is the
    ordinary single-process server; otherwise the process on --host/--port is a front (leanlm/fleet/front.py)
    that routes each request to one replica (docs/router.md)."""

    data_parallel_size: int = dataclasses.field(
        default=1,
        metadata={
            "help": "engine processes started on this machine, each an ordinary `leanlm serve` on a loopback port "
            "behind a routing front on --host/--port; 0 with --replicas: remote replicas only"
        },
    )
    replicas: str = dataclasses.field(
        default="",
        metadata={"help": "comma-separated base URLs of running `leanlm serve` replicas to route to as well"},
    )
    replica_api_key: str | None = dataclasses.field(
        default=None, metadata={"help": "bearer key the front sends to the --replicas (default: none)"}
    )
    router_policy: str = dataclasses.field(
        default="cache_aware",
        metadata={
            "help": "cache_aware: the replica holding the longest prompt prefix unless it is overloaded; "
            "round_robin; least_load: fewest requests in flight",
            "choices": ROUTER_POLICIES,
        },
    )
    balance_abs_threshold: int = dataclasses.field(
        default=4,
        metadata={
            "help": "cache_aware sends a prompt to the least-loaded replica instead of the one holding its prefix when "
            "that one has more than this many requests in flight above the least-loaded (and the relative gap holds)"
        },
    )
    balance_rel_threshold: float = dataclasses.field(
        default=1.5,
        metadata={"help": "... and more than this times the least-loaded replica's requests in flight"},
    )
    router_prefix_blocks: int = dataclasses.field(
        default=4, metadata={"help": "leading KV blocks of a prompt (--block-size tokens each) hashed for affinity"}
    )
    router_cache_entries: int = dataclasses.field(
        default=65536, metadata={"help": "block hashes the router remembers (least recently used ones go first)"}
    )
    health_check_interval_s: float = dataclasses.field(
        default=2.0, metadata={"help": "seconds between the front's health checks of each replica"}
    )
    replica_start_timeout_s: float = dataclasses.field(
        default=600.0, metadata={"help": "how long a local replica may take to load its model and answer /health"}
    )
    health_check_timeout_s: float = dataclasses.field(
        default=5.0,
        metadata={
            "help": "a replica whose /health takes longer is out of rotation, and its requests not yet streamed go to "
            "another replica (a stalled one: alive, silent)"
        },
    )
    replica_read_timeout_s: float = dataclasses.field(
        default=600.0,
        metadata={
            "help": "seconds the front waits for a replica's next bytes (a non-streamed answer comes whole: this "
            "bounds its whole generation); past it the request goes to another replica, or gets a 504"
        },
    )

    @property
    def replica_urls(self) -> tuple[str, ...]:
        return tuple(url.strip().rstrip("/") for url in self.replicas.split(",") if url.strip())

    @property
    def is_routed(self) -> bool:
        """True when the process on --host/--port is a front, not an engine."""
        return self.data_parallel_size != 1 or bool(self.replica_urls)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 0:
            raise ValueError(f"data_parallel_size must be >= 0, got {self.data_parallel_size}")
        if self.data_parallel_size == 0 and not self.replica_urls:
            raise ValueError("data_parallel_size 0 starts no engine: name remote ones with --replicas, or pass >= 1")
        for url in self.replica_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://, e.g. http://10.0.0.2:8000")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.router_policy!r}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.router_prefix_blocks < 1:
            raise ValueError(f"router_prefix_blocks must be >= 1, got {self.router_prefix_blocks}")
        if self.router_cache_entries < 1:
            raise ValueError(f"router_cache_entries must be >= 1, got {self.router_cache_entries}")
        if not self.health_check_interval_s > 0:
            raise ValueError(f"health_check_interval_s must be > 0, got {self.health_check_interval_s}")
        if not self.replica_start_timeout_s > 0:
            raise ValueError(f"replica_start_timeout_s must be > 0, got {self.replica_start_timeout_s}")
        if not 0 < self.health_check_timeout_s < math.inf:
            raise ValueError(f"health_check_timeout_s must be > 0 and finite, got {self.health_check_timeout_s}")
        if not 0 < self.replica_read_timeout_s < math.inf:
            raise ValueError(
                f"replica_read_timeout_s must be > 0 and finite, got {self.replica_read_timeout_s}; give a long one "
                "(3600) for long non-streamed generations"
            )
        if self.replica_api_key is not None and not self.replica_api_key.strip():
            raise ValueError("replica_api_key is empty; give a real key or leave it unset")
