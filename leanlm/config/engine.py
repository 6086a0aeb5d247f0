"""EngineConfig (the engine's knobs): a frozen dataclass, validated on construction. Each of its fields but the
three typed ones is a CLI flag; DecodingOptions holds the flags that spell speculative decoding and early exit
(leanlm.config.decoding), LongContextConfig's fields are flags of their own, and EngineConfig.from_options parses
them all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from leanlm.config.byte_count import byte_count, parse_bytes
from leanlm.config.decoding import EXIT_MEASURES, EarlyExitConfig, SpeculativeConfig
from leanlm.config.long_context import LongContextConfig, long_context_names
from leanlm.config.moe import RoutingPolicy

# KV-cache storage: the model dtype, or 8-bit values with a per-(token, KV head) scale (leanlm.model.kv_quant)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
# What a preempted request loses: its KV, recomputed later, or nothing, its blocks copied to host memory and back
PREEMPTION_MODES = ("auto", "recompute", "swap")
# activations of int weight-only layers: their own dtype, or int8 per group of 32 inputs (model.linear.act_quant)
ACT_QUANT_MODES = ("none", "int8", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the engine loop and the paged KV cache. Each field is a CLI flag of the commands that load a
    model; its `help` metadata is the flag's help (and says what the field means)."""

    block_size: int = dataclasses.field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int | None = dataclasses.field(
        default=None, metadata={"help": "KV pool size in blocks (default: sized from --kv-cache-memory-bytes)"}
    )
    kv_cache_memory_bytes: int = dataclasses.field(
        default=1 << 30,
        metadata={"parse": byte_count, "help": "KV pool budget in bytes (e.g. 1GiB) when --num-kv-blocks is not given"},
    )
    max_num_batched_tokens: int = dataclasses.field(
        default=2048, metadata={"help": "token budget of one engine step (prompt chunks + decodes)"}
    )
    max_num_seqs: int = dataclasses.field(
        default=128,
        metadata={"help": "most sequences running at once (serve: with --max-queue, the admission capacity)"},
    )
    num_threads: int | None = dataclasses.field(
        default=None,
        metadata={
            "flags": ("--threads",),
            "help": "CPU threads a step computes on (default: the cores other processes leave free, re-measured "
            "every 2 s; OMP_NUM_THREADS fixes it too). A parallel engine: threads per rank",
        },
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
    # leanlm.parallel: Megatron-style tensor parallelism x pipeline stages, one process per rank (gloo on CPU,
    # NCCL on GPU); rank 0 is the caller's process and runs the scheduler
    tensor_parallel_size: int = dataclasses.field(
        default=1, metadata={"help": "processes each layer's heads and FFN columns are split across"}
    )
    pipeline_parallel_size: int = dataclasses.field(
        default=1, metadata={"help": "pipeline stages the decoder layers are split into, one process group each"}
    )
    pipeline_microbatches: int | None = dataclasses.field(
        default=None,
        metadata={"help": "micro-batches a step's requests are split into for the pipeline (default: its stages)"},
    )
    parallel_timeout_s: float = dataclasses.field(
        default=300.0,
        metadata={
            "help": "a collective between the ranks that takes longer fails the engine with an error (starting the "
            "ranks and loading the model may take up to 900 s; a rank that exits meanwhile fails the start at once)"
        },
    )
    # leanlm.engine.preemption: auto picks per request whichever its cost estimate says is cheaper
    preemption_mode: str = dataclasses.field(
        default="auto",
        metadata={
            "choices": PREEMPTION_MODES,
            "help": "when KV blocks run out the newest running request is preempted: recompute (drop its KV, "
            "prefill again later) | swap (copy its blocks to host memory and back; needs --swap-space-bytes) | "
            "auto (whichever is estimated cheaper; recompute while --swap-space-bytes is 0)",
        },
    )
    swap_space_bytes: int = dataclasses.field(
        default=0,
        metadata={
            "parse": byte_count,
            "help": "host memory for swapped-out KV blocks (e.g. 64MB; pinned on a GPU); 0 disables swapping",
        },
    )
    # weight offloading (leanlm.model.offload): decoder layers beyond this many bytes of resident weights stream
    # in from a file (CPU) or pinned host memory (GPU) one at a time; None keeps every weight resident. A parallel
    # engine's budget is per rank: each offloads its own slice's layers
    max_weight_memory: int | None = dataclasses.field(
        default=None,
        metadata={
            "parse": byte_count,
            "help": "bytes of weights kept resident (e.g. 800000000 or 1.5GB), per rank of a parallel engine; "
            "decoder layers beyond it stream in one at a time, the next prefetched (default: every weight resident)",
        },
    )
    # mixture-of-experts routing (leanlm.model.moe): Switch's expert capacity and V-MoE's batch priority routing
    moe_capacity_factor: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "MoE models: each expert takes at most ceil(factor x step tokens x top-k / experts) tokens a "
            "step; the rest skip it (residual path) and are counted as dropped (default: no limit)"
        },
    )
    moe_batch_priority: bool = dataclasses.field(
        default=False,
        metadata={"help": "with --moe-capacity-factor: capacity goes to the tokens the router is surest of first"},
    )
    enable_expert_parallel: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "MoE models with --tensor-parallel-size N: each rank holds E/N whole experts and tokens reach "
            "them by all-to-all, instead of every expert split N ways"
        },
    )
    # dynamic int8 activations for weight-only int4/int8 layers (leanlm.model.linear.act_quant)
    act_quant: str = dataclasses.field(
        default="auto",
        metadata={
            "choices": ACT_QUANT_MODES,
            "help": "int8: int4 / int8 weight-only layers quantize their inputs to int8 per 32 (W4A8 / W8A8-dynamic, "
            "as llama.cpp and OpenVINO do) for VNNI int8 products; auto: int8 where VNNI runs them; none: 16-bit",
        },
    )
    # LoRA adapters (leanlm.model.lora, leanlm.engine.lora_manager): requests with different adapters share a batch
    enable_lora: bool = dataclasses.field(
        default=False, metadata={"help": "serve LoRA adapters (PEFT format) next to the base model, per request"}
    )
    max_loras: int = dataclasses.field(
        default=4,
        metadata={"help": "with --enable-lora: adapters held at once (slots); running requests use at most this many"},
    )
    max_lora_rank: int = dataclasses.field(
        default=16,
        metadata={"help": "with --enable-lora: the largest adapter rank r a slot holds (a larger is refused)"},
    )
    # speculative decoding (the --speculative flags of DecodingOptions parse into it); None: one token a step
    speculative: SpeculativeConfig | None = None
    # CALM early exit at decode (the --early-exit flags of DecodingOptions parse into it); None: every layer
    early_exit: EarlyExitConfig | None = None
    # long inputs: attention windows and sinks, prefill patterns, a KV budget (leanlm.config.long_context); its
    # fields are flags of their own, gathered by from_options
    long_context: LongContextConfig = LongContextConfig()

    def __post_init__(self) -> None:
        # byte counts as the flags spell them ('64MB', '1.5GiB') from LLM(...) too; the minimum is checked below
        for name in ("kv_cache_memory_bytes", "swap_space_bytes"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse_bytes(getattr(self, name), name, minimum=0))
        for name, cls in (("speculative", SpeculativeConfig), ("early_exit", EarlyExitConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise TypeError(
                    f"EngineConfig.{name} takes {cls.__name__} | None, got {value!r}: build one, or pass the CLI "
                    f"spelling to EngineConfig.from_options({name}=...) or LLM({name}=...)"
                )
        if not isinstance(self.long_context, LongContextConfig):
            raise TypeError(f"EngineConfig.long_context takes a LongContextConfig, got {self.long_context!r}")
        if self.early_exit is not None and self.speculative is not None:
            raise ValueError("early_exit and speculative decoding do not combine: choose one")
        self._check_parallel()
        self._check_kv_budget()
        self._check_lora()
        if self.max_weight_memory is not None:
            object.__setattr__(self, "max_weight_memory", parse_bytes(self.max_weight_memory, "max_weight_memory"))
            if self.early_exit is not None:
                raise ValueError(
                    "early_exit fills skipped layers' K/V through their weights, which weight offloading streams "
                    "in only as each layer runs: drop --early-exit or --max-weight-memory"
                )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of {', '.join(KV_CACHE_DTYPES)} "
                f"(auto keeps the model dtype)"
            )
        if self.act_quant not in ACT_QUANT_MODES:
            raise ValueError(f"act_quant must be one of {', '.join(ACT_QUANT_MODES)}, not {self.act_quant!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self._check_preemption()
        self.routing_policy()  # validates the MoE options
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel spreads experts over the tensor-parallel ranks: set "
                             "tensor_parallel_size > 1")  # fmt: skip
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise ValueError(f"num_threads (--threads) must be >= 1, got {self.num_threads}; omit it to size "
                             "threads to the free cores")  # fmt: skip
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: tensor x pipeline ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be >= 1, got {self.pipeline_microbatches}")
        if not self.parallel_timeout_s > 0:
            raise ValueError(f"parallel_timeout_s must be > 0, got {self.parallel_timeout_s}")
        if self.world_size > 1 and (self.speculative is not None or self.early_exit is not None):
            raise ValueError(
                "speculative decoding and early exit run in one process: drop them, or set tensor_parallel_size "
                "and pipeline_parallel_size to 1"
            )

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.enable_lora:
            return
        if self.world_size > 1:
            raise ValueError("LoRA adapters run in one process: set tensor_parallel_size and pipeline_parallel_size "
                             "to 1, or drop enable_lora")  # fmt: skip
        if self.early_exit is not None or self.max_weight_memory is not None:
            raise ValueError("LoRA adapters do not combine with early exit or weight offloading (both run layers "
                             "outside the adapter hooks): drop one")  # fmt: skip

    def _check_kv_budget(self) -> None:
        """A KV budget compacts one process's cache between steps, from the scores of one model's queries."""
        if self.long_context.kv_budget is None:
            return
        if self.long_context.kv_budget < 2:
            raise ValueError("kv_budget keeps recent and selected tokens: give at least 2")
        if self.speculative is not None or self.early_exit is not None:
            raise ValueError("kv_budget does not combine with speculative decoding or early exit: drop one")
        if self.world_size > 1:
            raise ValueError("kv_budget runs in one process: set tensor_parallel_size and pipeline_parallel_size to 1")

    def _check_preemption(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"unknown preemption_mode {self.preemption_mode!r}; use one of {', '.join(PREEMPTION_MODES)}"
            )
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0 (0 disables swapping), got {self.swap_space_bytes}")
        if self.preemption_mode == "swap" and self.swap_space_bytes == 0:
            raise ValueError("preemption_mode 'swap' needs host memory to swap to: set swap_space_bytes > 0")

    def routing_policy(self) -> RoutingPolicy:
        """The MoE layers' capacity and priority options."""
        try:
            return RoutingPolicy(self.moe_capacity_factor, self.moe_batch_priority)
        except ValueError as e:
            raise ValueError(f"{e} (--moe-capacity-factor / --moe-batch-priority)") from None

    @property
    def can_swap(self) -> bool:
        """Preemption may swap KV to host memory."""
        return self.preemption_mode != "recompute" and self.swap_space_bytes > 0

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """From the flat spelling of the CLI flags and LLM's keyword arguments: EngineConfig's own fields, with
        speculative decoding and early exit as DecodingOptions spells them (speculative='ngram',
        num_speculative_tokens=6, early_exit='24:0.9', ...), parsed here once. A SpeculativeConfig or
        EarlyExitConfig given as is is taken as is (its numbers then live in it, not in the flat options)."""
        unknown = set(options) - option_names()
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; they are {sorted(option_names())}")
        spelled = {f.name for f in dataclasses.fields(DecodingOptions)}
        decoding = DecodingOptions(**{k: v for k, v in options.items() if k in spelled})
        long_context = LongContextConfig(**{k: v for k, v in options.items() if k in long_context_names()})
        own = {k: v for k, v in options.items() if k not in spelled | long_context_names()}
        return cls(
            **own,
            speculative=decoding.speculative_config(),
            early_exit=decoding.early_exit_config(),
            long_context=long_context,
        )


@dataclass(frozen=True)
class DecodingOptions:
    """How the CLI flags and LLM's keyword arguments spell EngineConfig.speculative and .early_exit: a string
    and the numbers that go with it. Each field is a CLI flag; EngineConfig.from_options parses them, the only
    place that does."""

    speculative: str | SpeculativeConfig | None = dataclasses.field(
        default=None,
        metadata={
            "help": "speculative decoding: ngram (prompt lookup) | suffix (lookup resuming the copy after an edit) | "
            "lookahead (Jacobi + n-gram pool) | draft:MODEL | self:K (the target's first K layers); default: off"
        },
    )
    num_speculative_tokens: int = dataclasses.field(
        default=4, metadata={"help": "most draft tokens verified per request and step"}
    )
    speculative_max_batch_size: int = dataclasses.field(
        default=8, metadata={"help": "steps sampling more requests than this do not speculate"}
    )
    early_exit: str | EarlyExitConfig | None = dataclasses.field(
        default=None,
        metadata={
            "help": "CALM early exit at decode: K:THRESHOLD[,K:THRESHOLD...], a token leaves after K layers when its "
            "confidence there reaches THRESHOLD (leanlm train --exits prints calibrated ones); default: off"
        },
    )
    early_exit_measure: str = dataclasses.field(
        default="softmax",
        metadata={
            "choices": EXIT_MEASURES,
            "help": "CALM's confidence: the exit's top probability | its top-2 gap | the cosine of the hidden state "
            "before and after layer K",
        },
    )

    def speculative_config(self) -> SpeculativeConfig | None:
        if isinstance(self.speculative, SpeculativeConfig):
            given = (self.num_speculative_tokens, self.speculative_max_batch_size)
            if given != (_DEFAULTS.num_speculative_tokens, _DEFAULTS.speculative_max_batch_size):
                raise ValueError(
                    "with a SpeculativeConfig, set num_speculative_tokens and max_batch_size in it, not beside it"
                )
            return self.speculative
        if self.speculative is None:
            return None
        return SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens, self.speculative_max_batch_size)

    def early_exit_config(self) -> EarlyExitConfig | None:
        if isinstance(self.early_exit, EarlyExitConfig):
            if self.early_exit_measure != _DEFAULTS.early_exit_measure:
                raise ValueError("with an EarlyExitConfig, set its measure in it, not beside it")
            return self.early_exit
        if self.early_exit is None:
            return None
        return EarlyExitConfig.parse(self.early_exit, self.early_exit_measure)


_DEFAULTS = DecodingOptions()


def option_names() -> set[str]:
    """The keyword arguments EngineConfig.from_options (and so LLM) takes."""
    typed = {f.name for f in dataclasses.fields(EngineConfig)} - {"long_context"}
    return typed | {f.name for f in dataclasses.fields(DecodingOptions)} | long_context_names()
