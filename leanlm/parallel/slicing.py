"""What one rank reads of the checkpoint (a LoadSlice: its stage's layers, its experts, its slice of every linear) and
how its network, built on the meta device, is cut to the same shape (the tensor shard of tensor.py / expert.py,
then the stage of pipeline.py), so that a rank reads and holds only its part. The cuts here are those shard_model
makes; building the rank's network checks every tensor read against the cut network's shape."""

from __future__ import annotations

from collections.abc import Callable

from leanlm.config import ModelConfig
from leanlm.formats.load_slice import Cut, LoadSlice
from leanlm.model.linear.shard import COLUMN, ROW
from leanlm.model.llama import LlamaForCausalLM
from leanlm.parallel.expert import expert_bounds
from leanlm.parallel.heads import HeadShard, split_heads
from leanlm.parallel.pipeline import cut_stage, stage_bounds
from leanlm.parallel.tensor import shard_model
from leanlm.parallel.world import RankContext

_WRAPPERS = ("shard", "block")  # RowParallelLinear / VocabParallelHead .shard, the parallel MoE layers' .block


def plan_slice(config: ModelConfig, rank: RankContext, expert_parallel: bool) -> LoadSlice:
    """This rank's part of the checkpoint of `config`. A layout the model cannot take (a tensor size that does not
    divide its heads, more stages than layers) is refused here, before anything is read."""
    layout = rank.layout
    start, stop = stage_bounds(config.num_hidden_layers, layout.pipeline_parallel_size)[rank.stage]
    tp, r = rank.tp.size, rank.tp.rank
    cuts: dict[str, Cut] = {}
    experts = None
    if tp > 1:
        if config.qk_norm == "whole":
            raise ValueError(
                "OLMoE's q/k norms run over every head at once, which a tensor shard holds only part of: serve it "
                "with tensor_parallel_size 1 (pipeline_parallel_size splits its layers instead)"
            )
        heads = split_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        for i in range(start, stop):
            cuts |= _attention_cuts(config, heads, r, f"model.layers.{i}.self_attn.")
            cuts |= _mlp_cuts(config, i, r, tp, expert_parallel)
        cuts["model.embed_tokens"] = cuts["lm_head"] = Cut(COLUMN, r, tp)  # vocabulary-parallel rows
        if expert_parallel and config.moe is not None:
            bounds = expert_bounds(config.moe.num_experts, tp)
            experts = (bounds[r], bounds[r + 1])
    return LoadSlice(config.num_hidden_layers, start, stop, rank.is_first_stage, rank.is_last_stage, cuts, experts)


def _attention_cuts(config: ModelConfig, heads: list[HeadShard], r: int, prefix: str) -> dict[str, Cut]:
    """As tensor.shard_attention / shard_latent_attention cut them."""
    tp = len(heads)
    if config.mla is not None:
        mla = config.mla
        q = "q_proj" if mla.q_lora_rank is None else "q_b_proj"
        return {
            prefix + q: Cut(COLUMN, r, tp, tuple(h.num_heads * mla.qk_head_dim for h in heads)),
            prefix + "kv_b_proj": Cut(
                COLUMN, r, tp, tuple(h.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim) for h in heads)
            ),
            prefix + "o_proj": Cut(ROW, r, tp, tuple(h.num_heads * mla.v_head_dim for h in heads)),
        }
    d, mine = config.head_dim, heads[r]
    q_sizes = tuple(h.num_heads * d for h in heads)
    if len({(h.kv_start, h.kv_stop) for h in heads}) == tp:  # KV groups partitioned
        kv = Cut(COLUMN, r, tp, tuple(h.num_kv_heads * d for h in heads))
    else:  # each KV head replicated on the ranks that split its query heads
        kv = Cut(COLUMN, mine.kv_start, config.num_key_value_heads)
    return {
        prefix + "q_proj": Cut(COLUMN, r, tp, q_sizes),
        prefix + "k_proj": kv,
        prefix + "v_proj": kv,
        prefix + "o_proj": Cut(ROW, r, tp, q_sizes),
    }


def _mlp_cuts(config: ModelConfig, layer: int, r: int, tp: int, expert_parallel: bool) -> dict[str, Cut]:
    """As tensor.shard_mlp and expert.TensorParallelMoE cut them (expert parallelism keeps whole experts)."""
    prefix = f"model.layers.{layer}.mlp."
    if config.moe is None or not config.moe.is_sparse(layer):
        mlps = [prefix]
    elif expert_parallel:
        return {}
    else:
        mlps = [f"{prefix}experts.{e}." for e in range(config.moe.num_experts)]
        mlps += [prefix + "shared_expert."] if config.moe.shared_expert_intermediate_size else []
    cuts = {}
    for mlp in mlps:
        cuts |= {mlp + "gate_proj": Cut(COLUMN, r, tp), mlp + "up_proj": Cut(COLUMN, r, tp)}
        cuts[mlp + "down_proj"] = Cut(ROW, r, tp)
    return cuts


def arrange_rank(
    rank: RankContext, keep: LoadSlice, expert_parallel: bool, whole: list[ModelConfig]
) -> Callable[[LlamaForCausalLM], Callable[[str], str]]:
    """model/materialize.py's `arrange` for this rank: the meta network cut as build_rank cut a loaded one before
    (tensor shard, then stage); it records the whole model's config in `whole` and returns the map from the cut
    network's module names to the checkpoint's (wrappers dropped, the stage's layers numbered as in the file)."""

    def arrange(model: LlamaForCausalLM) -> Callable[[str], str]:
        whole.append(model.config)
        shard_model(model, rank.tp, expert_parallel)
        if rank.layout.pipeline_parallel_size > 1:
            cut_stage(model, keep.layer_start, keep.layer_stop, keep.has_embedding, keep.has_head)
        return lambda name: checkpoint_name(name, keep.layer_start)

    return arrange


def checkpoint_name(name: str, layer_start: int) -> str:
    """`model.layers.0.self_attn.o_proj.shard` of a stage starting at layer 12 -> `model.layers.12.self_attn.o_proj`."""
    parts = [p for p in name.split(".") if p not in _WRAPPERS] if name else []
    if len(parts) > 2 and parts[:2] == ["model", "layers"]:
        parts[2] = str(int(parts[2]) + layer_start)
    return ".".join(parts)
