"""ServeConfig: how `leanlm serve` listens and what it accepts; each field is a flag."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from leanlm.config.byte_count import byte_count


@dataclass(frozen=True)
class ServeConfig:
    """How the server listens and what it accepts (the engine's own settings live in EngineConfig). Each field
    is a `leanlm serve` flag; its `help` metadata is the flag's help (docs/serving.md lists the limits)."""

    host: str = dataclasses.field(
        default="127.0.0.1",
        metadata={"help": "address to listen on; loopback by default (exposing a model is your explicit choice)"},
    )
    port: int = dataclasses.field(default=8000, metadata={"help": "TCP port to listen on"})
    api_key: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "bearer key required on /v1 routes and /metrics (default: $LEANLM_API_KEY); without one only "
            "loopback Host names are answered"
        },
    )
    served_model_name: str | None = dataclasses.field(
        default=None, metadata={"help": "the name clients send as `model` (default: the --model value)"}
    )
    max_queue: int = dataclasses.field(
        default=256, metadata={"help": "sequences that may wait beyond max_num_seqs before requests get 429"}
    )
    max_body_bytes: int = dataclasses.field(
        default=16 * 1024 * 1024, metadata={"parse": byte_count, "help": "larger request bodies (e.g. 16MiB) get 413"}
    )
    shutdown_timeout_s: float = dataclasses.field(
        default=30.0, metadata={"help": "on SIGTERM, how long in-flight requests may take to finish"}
    )
    log_level: str = dataclasses.field(
        default="info", metadata={"help": "uvicorn and leanlm log level (debug, info, warning)"}
    )
    metrics_key: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "bearer key for /metrics only (default: $LEANLM_METRICS_KEY, else the API key; open if neither)"
        },
    )
    allowed_hosts: str = dataclasses.field(
        default="",
        metadata={"help": "comma-separated extra Host names answered without an API key (for a proxy), '*' for any"},
    )
    enable_docs: bool = dataclasses.field(
        default=False, metadata={"help": "serve /docs, /redoc and /openapi.json (open)"}
    )
    default_max_tokens: int = dataclasses.field(
        default=1024,
        metadata={"help": "tokens a chat request generates when it names no max_tokens (capped by the context)"},
    )
    max_prompt_chars: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "longest text prompt (or chat messages) tokenized; longer ones get 400 before tokenizing (default: "
            "the context length x the longest vocabulary entry, past which a prompt cannot fit the context)"
        },
    )
    max_pending_prepares: int = dataclasses.field(
        default=64,
        metadata={"help": "requests waiting to be parsed and tokenized; beyond it 429 with Retry-After"},
    )
    max_client_share: float = dataclasses.field(
        default=0.5,
        metadata={
            "help": "fraction of the admission capacity (max_num_seqs + max_queue sequences) one client address may "
            "hold; beyond it 429 with Retry-After"
        },
    )

    chat_control_tokens: str = dataclasses.field(
        default="text",
        metadata={
            "help": "a control token's text inside a chat message (e.g. '<|im_start|>system'): 'text' encodes its "
            "characters (a user cannot forge another role's turn), 'reject' answers 400, 'parse' makes it the "
            "control token, as HF, vLLM and llama-server do"
        },
    )
    tool_call_parser: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "the family whose tool calls chat replies are read for: 'hermes' (<tool_call> JSON: Qwen2.5, "
            "Hermes, SmolLM2), 'llama3_json' or 'mistral'; default: the one the chat template teaches (hermes for a "
            "template without tools, which is then prompted with them)"
        },
    )
    forwarded_allow_ips: str = dataclasses.field(
        default="",
        metadata={
            "help": "comma-separated proxy addresses whose X-Forwarded-For header names the client (for the "
            "per-client limit); empty: every client is its TCP peer and the header is ignored"
        },
    )

    max_connections: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "open HTTP connections kept; at the limit a new one replaces the oldest idle one (no request in "
            "progress), and with every one busy it gets a reserved connection (default: sized below the "
            "process's open-file limit, at most 2048)"
        },
    )
    reserved_connections: int = dataclasses.field(
        default=8,
        metadata={"help": "connections beyond --max-connections, when every one is busy, that answer /health only"},
    )
    header_timeout_s: float = dataclasses.field(
        default=10.0,
        metadata={
            "help": "seconds a connection has to send a complete request head, from when it opens or its previous "
            "response ends; a silent or slow one is closed"
        },
    )
    keep_alive_timeout_s: float = dataclasses.field(
        default=5.0, metadata={"help": "idle seconds after a response before a keep-alive connection is closed"}
    )
    body_timeout_s: float = dataclasses.field(
        default=30.0,
        metadata={"help": "seconds a request body may go without a byte arriving before its connection is closed"},
    )

    threads: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "torch threads of each engine process (default: torch's choice; with --data-parallel-size N: "
            "this machine's CPUs / N)"
        },
    )

    @property
    def trusted_proxy_ips(self) -> tuple[str, ...]:
        return tuple(ip.strip() for ip in self.forwarded_allow_ips.split(",") if ip.strip())

    @property
    def allowed_host_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.allowed_hosts.split(",") if name.strip())

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or unset (derived), got {self.max_prompt_chars}")
        if self.max_pending_prepares < 1:
            raise ValueError(f"max_pending_prepares must be >= 1, got {self.max_pending_prepares}")
        if not 0 < self.max_client_share <= 1:
            raise ValueError(
                f"max_client_share must be in (0, 1] (1: no per-client limit), got {self.max_client_share}"
            )
        if self.chat_control_tokens not in ("text", "reject", "parse"):
            raise ValueError(
                f"chat_control_tokens must be 'text', 'reject' or 'parse', got {self.chat_control_tokens!r}"
            )
        if self.tool_call_parser not in (None, "hermes", "llama3_json", "mistral"):
            raise ValueError(
                f"tool_call_parser must be 'hermes', 'llama3_json', 'mistral' or unset, got {self.tool_call_parser!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or unset (torch's choice), got {self.threads}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(
                f"max_connections must be >= 1 or unset (sized from the open-file limit), got {self.max_connections}"
            )
        if self.reserved_connections < 1:
            raise ValueError(
                f"reserved_connections must be >= 1 (they keep /health answering when every connection is busy), "
                f"got {self.reserved_connections}"
            )
        for name in ("header_timeout_s", "keep_alive_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):  # NaN fails too
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.metrics_key is not None and not self.metrics_key.strip():
            raise ValueError("metrics_key is empty; give a real key or leave it unset")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a real key or leave it unset")
