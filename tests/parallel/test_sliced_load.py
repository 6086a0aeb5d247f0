"""Each rank reads only its slice: the network a rank builds from its LoadSlice (meta, cut, then filled from the
tensors read already cut) holds exactly the tensors that loading the whole model and sharding it gave before, for
dense, int4 and 2:4 checkpoints, MoE with tensor-parallel experts and expert parallelism, every rank of TP=2, PP=2
and TP2xPP2; and a layout the model cannot take is refused before anything is read. No processes: one fake rank."""

from __future__ import annotations

import pytest
import torch

from leanlm.formats.fingerprint import read_config
from leanlm.formats.loader import load_checkpoint
from leanlm.loading.errors import ModelLoadError
from leanlm.parallel.pipeline import cut_stage, stage_bounds
from leanlm.parallel.slicing import arrange_rank, checkpoint_name, plan_slice
from leanlm.parallel.tensor import TensorGroup, shard_model
from leanlm.parallel.world import Layout, RankContext
from tests.parallel.test_expert_parallel import moe_checkpoint  # noqa: F401 (fixture)

RANKS = [(2, 1, 0, 0), (2, 1, 1, 0), (1, 2, 0, 0), (1, 2, 0, 1), (2, 2, 1, 0), (2, 2, 0, 1)]  # tp, pp, tp rank, stage


def fake_rank(tp: int, pp: int, tp_rank: int, stage: int) -> RankContext:
    """A rank's place without a world: building its network communicates with no one."""
    layout = Layout(tp, pp)
    group = TensorGroup(tp_rank, tp, None)
    return RankContext(layout.rank_at(stage, tp_rank), layout, group, None, None, torch.device("cpu"), 10.0)


def sliced(path: str, rank: RankContext, expert_parallel: bool = False, **options):
    keep = plan_slice(read_config(path), rank, expert_parallel)
    arrange = arrange_rank(rank, keep, expert_parallel, [])
    return load_checkpoint(path, "float32", "cpu", progress=False, keep=keep, arrange=arrange, **options).model


def sharded(path: str, rank: RankContext, expert_parallel: bool = False, **options):
    """What build_rank did before: the whole model, then its shard and stage."""
    model = load_checkpoint(path, "float32", "cpu", progress=False, **options).model
    num_layers = model.config.num_hidden_layers
    shard_model(model, rank.tp, expert_parallel)
    if rank.layout.pipeline_parallel_size > 1:
        start, stop = stage_bounds(num_layers, rank.layout.pipeline_parallel_size)[rank.stage]
        cut_stage(model, start, stop, rank.is_first_stage, rank.is_last_stage)
    return model


def assert_same_network(got, want) -> None:
    assert got.config == want.config
    got_state, want_state = got.state_dict(), want.state_dict()
    assert sorted(got_state) == sorted(want_state)
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert torch.equal(got_state[name], tensor), name
    if want.lm_head is not None and want.config.tie_word_embeddings and want.model.embed_tokens is not None:
        assert got.lm_head.shard.weight is got.model.embed_tokens.weight  # still one tensor


@pytest.mark.parametrize("fmt", ["dense", "int4", "2:4"])
@pytest.mark.parametrize("tp, pp, tp_rank, stage", RANKS)
def test_a_ranks_slice_equals_the_whole_model_sharded(parallel_checkpoints, fmt, tp, pp, tp_rank, stage):
    rank = fake_rank(tp, pp, tp_rank, stage)
    assert_same_network(sliced(parallel_checkpoints[fmt], rank), sharded(parallel_checkpoints[fmt], rank))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-experts", "expert-parallel"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_moe_ranks_read_their_experts_only(moe_checkpoint, expert_parallel, tp_rank):  # noqa: F811
    rank = fake_rank(2, 1, tp_rank, 0)
    got = sliced(moe_checkpoint, rank, expert_parallel)
    assert_same_network(got, sharded(moe_checkpoint, rank, expert_parallel))
    experts = [n for n in got.state_dict() if ".experts." in n and n.startswith("model.layers.0.")]
    held = {int(n.split(".experts.")[1].split(".")[0]) for n in experts}
    assert held == ({0, 1} if tp_rank == 0 else {2, 3, 4}) if expert_parallel else set(range(5))


def test_the_plan_holds_only_the_stages_layers_and_ends(parallel_checkpoints):
    config = read_config(parallel_checkpoints["dense"])
    keep = plan_slice(config, fake_rank(1, 2, 0, 1), False)
    assert (keep.layer_start, keep.layer_stop, keep.has_embedding, keep.has_head) == (2, 3, False, True)
    assert not keep.holds("model.layers.1.mlp.up_proj.weight") and keep.holds("model.layers.2.mlp.up_proj.weight")
    assert not keep.holds("model.embed_tokens.weight") and keep.holds("model.embed_tokens.weight", tied=True)
    assert checkpoint_name("model.layers.0.self_attn.o_proj.shard", 2) == "model.layers.2.self_attn.o_proj"


def test_a_tensor_size_the_heads_do_not_take_is_refused_before_reading(parallel_checkpoints):
    config = read_config(parallel_checkpoints["dense"])  # 6 heads in 3 KV groups: 4 ranks cannot split them
    with pytest.raises(ValueError, match="heads"):
        plan_slice(config, fake_rank(4, 1, 0, 0), False)


def test_a_header_that_disagrees_with_the_config_is_refused_before_reading(parallel_checkpoints, tmp_path):
    import json
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(parallel_checkpoints["dense"], path)
    raw = json.loads((path / "config.json").read_text())
    raw["intermediate_size"] = 512  # the file's MLP tensors are [256, 192]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="safetensors header"):
        sliced(str(path), fake_rank(2, 1, 0, 0))


@pytest.mark.real_model
@pytest.mark.parametrize("dequantize_gguf", [False, True], ids=["codes", "floats"])
@pytest.mark.parametrize("tp, pp, tp_rank, stage", [(2, 1, 1, 0), (1, 2, 0, 1), (2, 2, 0, 0)])
def test_a_gguf_ranks_slice_equals_the_whole_model_sharded(dequantize_gguf, tp, pp, tp_rank, stage):
    """The bundled SmolLM2 GGUF (9 heads in 3 KV groups: o_proj's rows split 384 + 192), on its 4-bit codes (each
    code layer cut as read, or built and cut by its format's shard()) and dequantized."""
    from tests.server.conftest import MODEL

    rank = fake_rank(tp, pp, tp_rank, stage)
    options = dict(dequantize_gguf=dequantize_gguf)
    assert_same_network(sliced(MODEL, rank, **options), sharded(MODEL, rank, **options))
