"""Model and engine configuration: frozen dataclasses, validated on construction.

`ModelConfig` describes one Llama-family decoder (llama, qwen2 are flags, not classes); it is built from an
HF `config.json` dict or from GGUF metadata (`leanlm.loading.gguf`). `EngineConfig` holds the engine knobs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# The longest context we build rotary tables for: 2^20 positions x D/2 x cos/sin in float32 is already 512 MiB
# at head_dim 128. A larger value in a file is damage (or a model we cannot serve), never something to allocate.
MAX_POSITION_EMBEDDINGS = 1 << 20
# KV-cache storage: the model dtype, or 8-bit values with a per-(token, KV head) scale (leanlm.model.kv_quant)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or aliases fp32/bf16/fp16) or a torch dtype -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    name = aliases.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (rope_type 'llama3'); 'linear' divides positions."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; use 'llama3' or 'linear'")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder, with HF field names."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES; qwen2 = llama + q/k/v bias
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int  # the context length
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q_proj / k_proj / v_proj (qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (eos, eot, im_end, ...)
    name: str = ""  # human-readable model name, for logs

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.max_position_embeddings > MAX_POSITION_EMBEDDINGS:
            raise ValueError(
                f"max_position_embeddings (context length) is {self.max_position_embeddings}, above the "
                f"{MAX_POSITION_EMBEDDINGS} positions leanlm builds rotary tables for; the model file is damaged, "
                "or fix the value in its config (a smaller context is safe: it only limits prompt + output length)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_scaling = None
        # transformers >= 5 writes `rope_parameters` (rope_theta inside); older configs `rope_scaling`.
        rope_params = cfg.get("rope_parameters") or {}
        raw_scaling = cfg.get("rope_scaling") or rope_params
        if raw_scaling:
            rope_type = raw_scaling.get("rope_type", raw_scaling.get("type"))
            if rope_type not in (None, "default"):
                rope_scaling = RopeScaling(
                    rope_type=rope_type,
                    factor=float(raw_scaling["factor"]),
                    low_freq_factor=float(raw_scaling.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(raw_scaling.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(raw_scaling.get("original_max_position_embeddings", 8192)),
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=str(cfg.get("_name_or_path", "")),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face loader reads for this model."""
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM" if self.architecture == "llama" else "Qwen2ForCausalLM"],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.architecture == "llama":
            cfg["attention_bias"] = self.attention_bias
            cfg["mlp_bias"] = False
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return cfg


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the engine loop and the paged KV cache. Each field is a CLI flag of the commands that load a
    model; its `help` metadata is the flag's help (and says what the field means)."""

    block_size: int = dataclasses.field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int | None = dataclasses.field(
        default=None, metadata={"help": "KV pool size in blocks (default: sized from --kv-cache-memory-bytes)"}
    )
    kv_cache_memory_bytes: int = dataclasses.field(
        default=1 << 30, metadata={"help": "KV pool budget in bytes when --num-kv-blocks is not given"}
    )
    max_num_batched_tokens: int = dataclasses.field(
        default=2048, metadata={"help": "token budget of one engine step (prompt chunks + decodes)"}
    )
    max_num_seqs: int = dataclasses.field(
        default=128,
        metadata={"help": "most sequences running at once (serve: with --max-queue, the admission capacity)"},
    )
    max_model_len: int | None = dataclasses.field(
        default=None, metadata={"help": "context limit in tokens (default: the model's max_position_embeddings)"}
    )
    enable_prefix_caching: bool = dataclasses.field(
        default=True, metadata={"help": "reuse the KV blocks of shared prompt prefixes"}
    )
    # 8-bit storage keeps a float32 scale per token and KV head (leanlm.model.kv_quant)
    kv_cache_dtype: str = dataclasses.field(
        default="auto",
        metadata={
            "choices": KV_CACHE_DTYPES,
            "help": "KV storage: auto (the model dtype), or 8-bit int8 | fp8_e4m3 | fp8_e5m2 with per-token scales",
        },
    )
    speculative: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "speculative decoding: ngram (prompt lookup) | lookahead (Jacobi + n-gram pool) | draft:MODEL | "
            "self:K (the target's first K layers); default: off, one token a step"
        },
    )
    num_speculative_tokens: int = dataclasses.field(
        default=4, metadata={"help": "most draft tokens verified per request and step"}
    )
    speculative_max_batch_size: int = dataclasses.field(
        default=8, metadata={"help": "steps sampling more requests than this do not speculate"}
    )

    def __post_init__(self) -> None:
        if self.speculative is not None:
            _ = self.speculative_config  # parses and validates the proposer name
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)} "
                f"(auto keeps the model dtype)"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        return dataclasses.replace(
            SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens),
            max_batch_size=self.speculative_max_batch_size,
        )


SPECULATIVE_METHODS = ("ngram", "draft", "self", "lookahead")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How speculative decoding proposes and how much it verifies (Leviathan et al. 2023, Chen et al. 2023).

    The number of draft tokens adapts to each request's acceptance rate: k maximizes expected tokens per unit
    of step cost, where one step costs 1 + verify_overhead (when k > 0) + draft_cost * k.
    """

    # ngram: prompt lookup, the continuation of the latest earlier match of the context's tail; draft: a smaller
    # model with the same tokenizer; self: the target's own first layers with its final norm and head;
    # lookahead: Jacobi iteration of the target itself plus an n-gram pool (no draft model)
    method: str
    draft_model: str | None = None  # draft: a bundled name, GGUF file or HF directory (a quantized copy works)
    num_draft_layers: int | None = None  # self: how many of the target's first layers draft
    num_speculative_tokens: int = 4  # most draft tokens per request and step (k)
    prompt_lookup_min: int = 1  # ngram: shortest tail n-gram that may match
    prompt_lookup_max: int = 4  # ngram: longest tail n-gram tried first
    adaptive: bool = True  # adapt k to each request's acceptance rate; False always proposes up to k
    max_batch_size: int = 8  # steps sampling more requests than this do not speculate: verification stops paying
    verify_overhead: float = 0.2  # a verifying step's extra cost over a plain decode step (relative)
    # each draft token's extra cost (proposing it and verifying its row), relative to a target step; None: 0.05
    # for n-gram drafts, and for a draft model its measured step time over the target's (before 3 of each are
    # measured: its weight bytes over the target's, as a decode step reads every weight)
    draft_cost: float | None = None
    probe_interval: int = 16  # steps a request waits at k = 0 before proposing again to re-measure acceptance

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {', '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model goes with method 'draft' (and only with it): use --speculative draft:MODEL")
        if (self.method == "self") != (self.num_draft_layers is not None):
            raise ValueError("a layer count goes with method 'self' (and only with it): use --speculative self:K")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ValueError(f"self-speculation needs at least 1 draft layer, got {self.num_draft_layers}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.verify_overhead < 0 or (self.draft_cost is not None and self.draft_cost < 0):
            raise ValueError("verify_overhead and draft_cost are relative costs and must be >= 0")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}")

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model that writes KV for them: the scheduler reserves lookahead slots."""
        return self.method in ("draft", "self")

    @classmethod
    def parse(cls, spec: str, num_speculative_tokens: int = 4) -> SpeculativeConfig:
        """From the CLI form: 'ngram', 'lookahead', 'draft:MODEL' or 'self:K'."""
        method, _, arg = spec.strip().partition(":")
        if method == "draft":
            if not arg:
                raise ValueError("--speculative draft needs a model: draft:MODEL (a name, GGUF file or directory)")
            return cls(method, draft_model=arg, num_speculative_tokens=num_speculative_tokens)
        if method == "self":
            if not arg.isdigit():
                raise ValueError(f"--speculative self needs a layer count: self:K, got {spec!r}")
            return cls(method, num_draft_layers=int(arg), num_speculative_tokens=num_speculative_tokens)
        if arg:
            raise ValueError(f"speculative method {method!r} takes no argument, got {spec!r}")
        return cls(method, num_speculative_tokens=num_speculative_tokens)


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
        default=16 * 1024 * 1024, metadata={"help": "larger request bodies get 413"}
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
    max_client_share: float = dataclasses.field(
        default=0.5,
        metadata={
            "help": "fraction of the admission capacity (max_num_seqs + max_queue sequences) one client address may "
            "hold; beyond it 429 with Retry-After"
        },
    )

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
        if not 0 < self.max_client_share <= 1:
            raise ValueError(
                f"max_client_share must be in (0, 1] (1: no per-client limit), got {self.max_client_share}"
            )
        if self.metrics_key is not None and not self.metrics_key.strip():
            raise ValueError("metrics_key is empty; give a real key or leave it unset")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a real key or leave it unset")
