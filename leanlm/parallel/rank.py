"""One rank of a parallel engine: what it loads (RankSpec), the startup check that every rank loaded the same thing,
its slice of the model (tensor shard, then pipeline stage), and the forward it runs for each step's plans."""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import DistStoreError

from leanlm.config import EngineConfig, LongContextConfig, ModelConfig
from leanlm.engine import ModelRunner, StepOutput, StepPlan, kv_cache_bytes_per_block
from leanlm.formats.fingerprint import checkpoint_fingerprint, read_config
from leanlm.formats.loader import load_checkpoint
from leanlm.loading.tokenizer import Tokenizer
from leanlm.model.device import resolve_dtype
from leanlm.model.kv_quant import kv_storage_dtype
from leanlm.model.llama import LlamaForCausalLM
from leanlm.model.offload import OffloadedLayers, offload_layers
from leanlm.parallel import wire
from leanlm.parallel.pipeline import run_pipeline, stage_bounds
from leanlm.parallel.slicing import arrange_rank, plan_slice
from leanlm.parallel.tensor import kv_heads_per_rank
from leanlm.parallel.world import DRIVER_RANK, Layout, RankContext, init_rank, join_store, wait_for_ranks

_TYPED = ("speculative", "early_exit")  # EngineConfig fields that are not JSON (refused with parallelism anyway)


@dataclass(frozen=True)
class RankSpec:
    """What every rank loads and how it joins the world; the driver hands it to the workers as JSON."""

    model: str  # a bundled name, GGUF file or checkpoint directory, as LLM(model=...) takes it
    dtype: str  # as LLM(dtype=...) takes it ("auto", "float32", ...)
    device: str  # "cpu" or "cuda" (rank r drives cuda:r)
    attention_backend: str
    dequantize_gguf: bool  # as LLM(dequantize_gguf=...): a GGUF's quantized linears as floats, not on their codes
    engine: dict[str, Any]  # EngineConfig's fields but the typed ones
    init_method: str  # tcp://127.0.0.1:port (the driver's store), or env:// under torchrun
    # the world's shared secret (hex; None under torchrun): it reaches the workers in their environment, which only
    # this user can read, never on a command line
    secret: str | None = dataclasses.field(default=None, repr=False)

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
    offloaded: OffloadedLayers | None = None  # this rank's layers beyond max_weight_memory (None: all resident)


def all_gather_bytes(rank: RankContext, data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order (two gloo all_gathers: the lengths, then the bytes padded to the longest)."""
    world = rank.layout.world_size
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=rank.control)
    sizes = [int(n.item()) for n in lengths]
    if not all(0 <= n <= wire.MAX_MESSAGE_BYTES for n in sizes):
        raise wire.WireError(f"a rank announced a start-up message of {max(sizes)} bytes; a peer is not one of ours")
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
    chunks = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(chunks, padded, group=rank.control)
    return [chunk[:n].numpy().tobytes() for chunk, n in zip(chunks, sizes, strict=True)]


def check_agreement(rank: RankContext, facts: dict[str, str]) -> None:
    """Every rank's facts (model, config, engine config, dtype, the checkpoint's fingerprint: its headers, sizes and
    a sample of its data, formats/fingerprint.py) must equal the driver's; otherwise every rank raises, naming what
    differs where (a checkpoint changed on disk between loads, a different file on one host). In a local world each
    rank also proves it holds the secret: a process that reached the store first and took a worker's place makes
    every rank refuse to start."""
    facts = {**facts, "proof": rank.proof(f"rank/{rank.rank}")}
    gathered = []
    for r, data in enumerate(all_gather_bytes(rank, wire.encode_json(facts))):
        theirs = wire.decode_json(data)
        if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
            raise wire.WireError(f"rank {r}'s start-up facts are not a JSON object of strings")
        gathered.append(theirs)
    impostors = [r for r, theirs in enumerate(gathered) if theirs.pop("proof", None) != rank.proof(f"rank/{r}")]
    if impostors:
        raise PermissionError(
            f"rank(s) {impostors} did not prove the engine's secret: a process that is not one of its workers "
            "joined the world through its store (another program on this machine?); the engine refuses to start"
        )
    driver = gathered[DRIVER_RANK]
    wrong = [(r, k) for r, theirs in enumerate(gathered) for k in driver if theirs.get(k) != driver[k]]
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
    # sized for its KV only: per-layer windows and expert layers of a shorter stack are not what it measures
    moe = None if config.moe is None else dataclasses.replace(config.moe, sparse_layers=None)
    largest = dataclasses.replace(
        largest, num_hidden_layers=layers, layer_windows=config.layer_windows[:layers], moe=moe
    )
    per_block = kv_cache_bytes_per_block(largest, engine_config.block_size, kv_dtype)
    num_blocks = engine_config.kv_cache_memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={engine_config.kv_cache_memory_bytes} holds no KV block on a rank")
    return num_blocks


def build_rank(
    spec: RankSpec,
    rank_idx: int,
    progress: bool = False,
    store: dist.Store | None = None,
    check_peers: Callable[[], None] | None = None,
) -> RankModel:
    """Join the world, check that every rank is about to load the same checkpoint (from its headers), then read only
    this rank's slice of it into a network built at the slice's size (formats/load_slice.py, parallel/slicing.py),
    and offload its layers beyond max_weight_memory. The driver of a local world passes the store it serves
    (world.serve_store) and `check_peers` (raises if a worker exited); a worker joins the store at spec.init_method.
    Ranks wait for each other before forming the groups and after loading for world.START_TIMEOUT_S, not
    parallel_timeout_s (which bounds steps)."""
    layout = spec.layout
    engine_config = spec.engine_config()
    timeout_s = engine_config.parallel_timeout_s
    if store is None and spec.init_method.startswith("tcp://"):
        store = join_store(spec.init_method, layout.world_size, timeout_s)
    if store is not None:  # under torchrun (env://) its rendezvous waits for the ranks
        wait_for_ranks(store, rank_idx, layout.world_size, "joined", spec.secret, check_peers)
    rank = init_rank(rank_idx, layout, torch.device(spec.device), timeout_s, store, spec.secret)
    config = read_config(spec.model)  # the headers only: the slice is planned, and the ranks agree, before any read
    dtype = resolve_dtype(spec.dtype, rank.device, config)
    expert_parallel = engine_config.enable_expert_parallel
    keep = plan_slice(config, rank, expert_parallel)
    fingerprint = checkpoint_fingerprint(spec.model)
    facts = {
        "model": spec.model,
        "config": repr(config),
        "engine config": repr(engine_config),
        "dtype": str(dtype),
        "checkpoint": fingerprint,
    }
    check_agreement(rank, facts)
    options = dict(attention_backend=spec.attention_backend, progress=progress, dequantize_gguf=spec.dequantize_gguf)
    whole: list[ModelConfig] = []  # the whole model's config, as the loader built it (sharding replaces it)
    arrange = arrange_rank(rank, keep, expert_parallel, whole)
    checkpoint = load_checkpoint(spec.model, dtype, rank.device, keep=keep, arrange=arrange, **options)
    if checkpoint_fingerprint(spec.model) != fingerprint:
        raise ValueError(f"rank {rank_idx}: {spec.model} changed on disk while it was read; load it again")
    if rank.store is not None:
        wait_for_ranks(rank.store, rank_idx, layout.world_size, "loaded", spec.secret, check_peers)
    model, config = checkpoint.model, whole[0]
    limit = engine_config.max_weight_memory  # this rank's budget for its own slice's weights
    offloaded = None if limit is None else offload_layers(model, limit)
    kv_dtype = kv_storage_dtype(engine_config.kv_cache_dtype, dtype)
    blocks = parallel_num_kv_blocks(config, engine_config, kv_dtype)
    engine_config = dataclasses.replace(engine_config, num_kv_blocks=blocks)
    return RankModel(rank, config, model, checkpoint.tokenizer, engine_config, dtype, offloaded)


def run_plans(rank_model: RankModel, runner: ModelRunner, plans: list[StepPlan]) -> list[StepOutput]:
    """This rank's part of the step: each plan's forward (tensor parallel), or the micro-batches through its stage."""
    if rank_model.rank.layout.pipeline_parallel_size == 1 or not any(plan.num_tokens for plan in plans):
        return [runner.forward(plan) for plan in plans]  # a plan of no tokens only moves blocks
    return run_pipeline(runner, rank_model.rank, plans, rank_model.config.hidden_size, rank_model.dtype)


IDLE_POLL = datetime.timedelta(seconds=30)  # how long a worker waits on the store before it asks again


def receive_plans(rank: RankContext, step: int) -> list[StepPlan] | None:
    """The driver's step number `step` (None: shut down). The worker waits for the step's key on the store, as long
    as the engine idles, then joins the broadcast (which, like every collective, times out). The key's name comes
    from the secret (RankContext.step_key): nobody without it can make a worker enter a broadcast."""
    while True:
        try:
            rank.store.wait([rank.step_key(step)], IDLE_POLL)
            break
        except DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise  # the driver's store is gone: the driver died
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=DRIVER_RANK, group=rank.control)
    if not 0 < int(size.item()) <= wire.MAX_MESSAGE_BYTES:
        raise wire.WireError(f"the driver announced a step message of {int(size.item())} bytes")
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=DRIVER_RANK, group=rank.control)
    return wire.decode_plans(data.numpy().tobytes(), rank.device)


def send_plans(rank: RankContext, step: int, plans: list[StepPlan] | None) -> None:
    """Announce step `step`, broadcast its plans (None: shut down) as bytes (wire.py: no pickles), and drop the key
    of the step before it (every worker has passed it: each joined this broadcast)."""
    data = torch.frombuffer(bytearray(wire.encode_plans(plans)), dtype=torch.uint8)
    rank.store.set(rank.step_key(step), b"")
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=DRIVER_RANK, group=rank.control)
    dist.broadcast(data, src=DRIVER_RANK, group=rank.control)
    if step > 0:
        rank.store.delete_key(rank.step_key(step - 1))
