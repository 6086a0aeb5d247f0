"""EngineLayout: what an engine runs on and how it is spread (device, dtypes, threads, KV pool, weight offloading,
tensor / pipeline / expert parallelism, MoE routing, speculation), read once after start-up: the line the CLI and
the server's start-up log print, and the static gauges of /metrics."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.kernels import isa
from leanlm.model.offload import OffloadPlan


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class EngineLayout:
    architecture: str  # the model family (llama, qwen2, mixtral, ...)
    num_layers: int  # decoder layers of the whole model
    device: str
    dtype: str  # compute dtype
    num_threads: int  # CPU threads a step computes on now (per rank)
    automatic_threads: bool  # sized to the free cores (leanlm.engine.threads), not fixed
    num_kv_blocks: int
    block_size: int  # tokens per KV block
    kv_cache_dtype: str
    kv_cache_bytes: int
    num_streamed_layers: int  # decoder layers whose weights stream in as they run (--max-weight-memory); 0: none
    resident_weight_bytes: int | None  # weights that stay in memory under offloading; None: no offloading
    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel: bool  # experts split over the tensor ranks rather than each expert's columns
    num_experts: int | None  # per MoE layer; None: a dense model
    top_k: int | None  # experts per token
    moe_capacity_factor: float | None  # Switch capacity: assignments beyond it are dropped (None: no cap)
    speculative: str | None  # the speculative method, or None
    kernels: str = ""  # on a CPU: the native kernels' ISA level and the CPU's (leanlm.kernels.isa); "" elsewhere

    @classmethod
    def of(cls, engine, offload: OffloadPlan | None) -> EngineLayout:
        """The layout of an LLMEngine, with the offload plan its LLM made (None: every layer resident)."""
        cfg, ec = engine.model_config, engine.engine_config
        moe = cfg.moe
        threads = engine.executor.threads
        return cls(
            architecture=cfg.architecture,
            num_layers=cfg.num_hidden_layers,
            device=str(engine.device),
            dtype=_name(engine.model_dtype),
            num_threads=threads.num_threads if threads is not None else _torch_threads(),
            automatic_threads=threads is not None and threads.is_automatic,
            num_kv_blocks=engine.num_kv_blocks,
            block_size=ec.block_size,
            kv_cache_dtype=_name(engine.kv_cache_dtype),
            kv_cache_bytes=engine.kv_cache_bytes,
            num_streamed_layers=len(offload.streamed_idx) if offload is not None else 0,
            resident_weight_bytes=offload.resident_bytes if offload is not None else None,
            tensor_parallel_size=ec.tensor_parallel_size,
            pipeline_parallel_size=ec.pipeline_parallel_size,
            expert_parallel=ec.enable_expert_parallel,
            num_experts=moe.num_experts if moe is not None else None,
            top_k=moe.top_k if moe is not None else None,
            moe_capacity_factor=ec.moe_capacity_factor,
            speculative=ec.speculative.method if ec.speculative is not None else None,
            kernels=isa.describe() if str(engine.device) == "cpu" else "",
        )

    def describe(self) -> str:
        """One line: `engine: ...`."""
        threads = f"{self.num_threads} thread{'s' * (self.num_threads != 1)}"
        threads += " (sized to the free cores)" if self.automatic_threads else " (fixed)"
        parts = [
            f"{self.architecture}, {self.num_layers} layers, {self.dtype} on {self.device}, {threads}",
            f"KV cache {self.num_kv_blocks} blocks x {self.block_size} tokens ({self.kv_cache_dtype}, "
            f"{self.kv_cache_bytes / 2**20:,.1f} MiB)",
        ]
        if self.num_streamed_layers:
            parts.append(
                f"weights offloaded: {self.num_layers - self.num_streamed_layers} layers resident "
                f"({self.resident_weight_bytes / 2**20:,.0f} MiB), {self.num_streamed_layers} streamed"
            )
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            experts = ", experts split over the tensor ranks" if self.expert_parallel else ""
            parts.append(
                f"parallel: tensor {self.tensor_parallel_size} x pipeline {self.pipeline_parallel_size}{experts}"
            )
        if self.num_experts is not None:
            cap = f", capacity factor {self.moe_capacity_factor:g}" if self.moe_capacity_factor else ""
            parts.append(f"MoE: {self.num_experts} experts, top-{self.top_k}{cap}")
        if self.speculative:
            parts.append(f"speculative: {self.speculative}")
        if self.kernels:
            parts.append(self.kernels)
        return "engine: " + "; ".join(parts)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
