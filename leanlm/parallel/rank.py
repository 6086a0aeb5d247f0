"""One rank of a parallel engine: what it loads (RankSpec), the startup check that every rank loaded the same thing,
its slice of the model (tensor shard, then pipeline stage), and the forward it runs for each step's plans."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import DistStoreError

from leanlm.config import EngineConfig, LongContextConfig, ModelConfig
from leanlm.engine import ModelRunner, StepPlan, kv_cache_bytes_per_block
from leanlm.formats.loader import load_checkpoint
from leanlm.loading.tokenizer import Tokenizer
from leanlm.model.kv_quant import kv_storage_dtype
from leanlm.model.llama import LlamaForCausalLM
from leanlm.parallel.pipeline import cut_stage, run_pipeline, stage_bounds
from leanlm.parallel.tensor import kv_heads_per_rank, shard_model
from leanlm.parallel.world import DRIVER_RANK, Layout, RankContext, init_rank

_TYPED = ("speculative", "early_exit")  # EngineConfig fields that are not JSON (refused with parallelism anyway)


@dataclass(frozen=True)
class RankSpec:
    """What every rank loads and how it joins the world; the driver hands it to the workers as JSON."""

    model: str  # a bundled name, GGUF file or checkpoint directory, as LLM(model=...) takes it
    dtype: str  # as LLM(dtype=...) takes it ("auto", "float32", ...)
    device: str  # "cpu" or "cuda" (rank r drives cuda:r)
    attention_backend: str
    gguf_codes: bool  # run a GGUF's quantized linears on their codes (LLM's dequantize_gguf=False)
    engine: dict[str, Any]  # EngineConfig's fields but the typed ones
    init_method: str  # tcp://host:port, or env:// under torchrun

    @classmethod
    def of(
        cls, model: str, dtype: str | torch.dtype, device: torch.device, engine_config: EngineConfig, **kw
    ) -> RankSpec:
        fields = {f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)}
        engine = {k: v for k, v in fields.items() if k not in _TYPED}
        engine["long_context"] = dataclasses.asdict(engine_config.long_context)  # JSON: rebuilt by engine_config()
        dtype = str(dtype).removeprefix("torch.")
        return cls(model=model, dtype=dtype, device=device.type, engine=engine, **kw)

    @property
    def layout(self) -> Layout:
        return Layout(self.engine["tensor_parallel_size"], self.engine["pipeline_parallel_size"])

    def engine_config(self) -> EngineConfig:
        long_context = LongContextConfig(**self.engine.get("long_context", {}))
        return EngineConfig(**{**self.engine, "long_context": long_context})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


@dataclass
class RankModel:
    """A rank's loaded part of the engine."""

    rank: RankContext
    config: ModelConfig  # the whole model's
    model: LlamaForCausalLM  # this rank's tensor slice of its stage's layers
    tokenizer: Tokenizer
    engine_config: EngineConfig  # num_kv_blocks fixed: the same on every rank
    dtype: torch.dtype  # the compute dtype the loader resolved


def weights_digest(model: LlamaForCausalLM) -> str:
    """BLAKE2b of every tensor of the (whole, unsharded) model, names and bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str((t.dtype, tuple(t.shape))).encode())
        digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_agreement(rank: RankContext, facts: dict[str, str]) -> None:
    """Every rank's facts (model, config, engine config, dtype, weights' digest) must equal the driver's; otherwise
    every rank raises, naming what differs where (a checkpoint changed on disk between loads, a different file on
    one host)."""
    gathered: list[dict[str, str] | None] = [None] * rank.layout.world_size
    dist.all_gather_object(gathered, facts, group=rank.control)
    driver = gathered[DRIVER_RANK]
    wrong = [(r, k) for r, theirs in enumerate(gathered) for k in driver if theirs[k] != driver[k]]
    if wrong:
        what = ", ".join(f"rank {r}'s {k}" for r, k in wrong[:6])
        raise ValueError(f"the ranks did not load the same model: {what} differ from rank 0's; load one checkpoint")


def parallel_num_kv_blocks(config: ModelConfig, engine_config: EngineConfig, kv_dtype: torch.dtype) -> int:
    """KV blocks every rank holds: kv_cache_memory_bytes (per rank) over the block bytes of the largest rank (most KV
    heads, most layers), so that all ranks' pools have the same block ids."""
    if engine_config.num_kv_blocks is not None:
        return engine_config.num_kv_blocks
    tp, pp = engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size
    heads = kv_heads_per_rank(config.num_attention_heads, config.num_key_value_heads, tp)
    layers = max(stop - start for start, stop in stage_bounds(config.num_hidden_layers, pp))
    largest = dataclasses.replace(config, num_attention_heads=heads, num_key_value_heads=heads)
    largest = dataclasses.replace(largest, num_hidden_layers=layers)
    per_block = kv_cache_bytes_per_block(largest, engine_config.block_size, kv_dtype)
    num_blocks = engine_config.kv_cache_memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={engine_config.kv_cache_memory_bytes} holds no KV block on a rank")
    return num_blocks


def build_rank(spec: RankSpec, rank_idx: int, progress: bool = False) -> RankModel:
    """Join the world, load the checkpoint, check that every rank loaded the same one, keep this rank's slice."""
    layout = spec.layout
    engine_config = spec.engine_config()
    rank = init_rank(rank_idx, layout, spec.init_method, torch.device(spec.device), engine_config.parallel_timeout_s)
    options = dict(attention_backend=spec.attention_backend, progress=progress, gguf_codes=spec.gguf_codes)
    checkpoint = load_checkpoint(spec.model, spec.dtype, rank.device, **options)
    model, config = checkpoint.model, checkpoint.model.config  # the whole model's: sharding replaces model.config
    dtype = model.model.norm.weight.dtype
    facts = {
        "model": spec.model,
        "config": repr(config),
        "engine config": repr(engine_config),
        "dtype": str(dtype),
        "weights": weights_digest(model),
    }
    check_agreement(rank, facts)
    shard_model(model, rank.tp, engine_config.enable_expert_parallel)
    if layout.pipeline_parallel_size > 1:
        start, stop = stage_bounds(config.num_hidden_layers, layout.pipeline_parallel_size)[rank.stage]
        cut_stage(model, start, stop, rank.is_first_stage, rank.is_last_stage)
    kv_dtype = kv_storage_dtype(engine_config.kv_cache_dtype, dtype)
    blocks = parallel_num_kv_blocks(config, engine_config, kv_dtype)
    engine_config = dataclasses.replace(engine_config, num_kv_blocks=blocks)
    return RankModel(rank, config, model, checkpoint.tokenizer, engine_config, dtype)


def run_plans(rank_model: RankModel, runner: ModelRunner, plans: list[StepPlan]) -> list[torch.Tensor]:
    """This rank's part of the step: each plan's forward (tensor parallel), or the micro-batches through its stage."""
    if rank_model.rank.layout.pipeline_parallel_size == 1 or not any(plan.num_tokens for plan in plans):
        return [runner.forward(plan) for plan in plans]  # a plan of no tokens only moves blocks
    return run_pipeline(runner, rank_model.rank, plans, rank_model.config.hidden_size, rank_model.dtype)


IDLE_POLL = datetime.timedelta(seconds=30)  # how long a worker waits on the store before it asks again


def receive_plans(rank: RankContext, step: int) -> list[StepPlan] | None:
    """The driver's step number `step` (None: shut down). The worker waits for the step's key on the store, as long
    as the engine idles, then joins the broadcast (which, like every collective, times out)."""
    while True:
        try:
            rank.store.wait([str(step)], IDLE_POLL)
            break
        except DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise  # the driver's store is gone: the driver died
    box: list[list[StepPlan] | None] = [None]
    dist.broadcast_object_list(box, src=DRIVER_RANK, group=rank.control)
    return box[0]


def send_plans(rank: RankContext, step: int, plans: list[StepPlan] | None) -> None:
    """Announce step `step`, broadcast its plans (None: shut down), and drop the key of the step before it (every
    worker has passed it: each joined this broadcast)."""
    rank.store.set(str(step), b"")
    dist.broadcast_object_list([plans], src=DRIVER_RANK, group=rank.control)
    if step > 0:
        rank.store.delete_key(str(step - 1))
