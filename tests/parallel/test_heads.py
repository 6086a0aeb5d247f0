"""leanlm.parallel.heads / pipeline / world / step_plan: the pure arithmetic of how work splits across ranks."""

from __future__ import annotations

import pytest

from leanlm.config import EngineConfig
from leanlm.model.linear.shard import COLUMN, ROW, part
from leanlm.parallel.heads import HeadShard, split_heads
from leanlm.parallel.pipeline import stage_bounds
from leanlm.parallel.world import Layout


def test_kv_groups_split_as_evenly_as_they_can():
    # SmolLM2: 9 heads in 3 KV groups over 2 ranks -> 2 + 1 groups
    assert split_heads(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 9, 2, 3)]
    # Qwen2.5 0.5B: 14 heads / 2 KV over 2 ranks -> one group each
    assert split_heads(14, 2, 2) == [HeadShard(0, 7, 0, 1), HeadShard(7, 14, 1, 2)]
    assert split_heads(8, 8, 4) == [HeadShard(2 * i, 2 * i + 2, 2 * i, 2 * i + 2) for i in range(4)]


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head():
    # 14 heads / 2 KV over 4 ranks: each KV head on 2 ranks, which split its 7 query heads 4 + 3
    assert split_heads(14, 2, 4) == [
        HeadShard(0, 4, 0, 1),
        HeadShard(4, 7, 0, 1),
        HeadShard(7, 11, 1, 2),
        HeadShard(11, 14, 1, 2),
    ]


@pytest.mark.parametrize("heads, kv, world", [(9, 3, 4), (4, 2, 3), (4, 2, 8)])
def test_impossible_head_splits_say_what_to_choose(heads, kv, world):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        split_heads(heads, kv, world)


def test_uneven_shard_sizes_cut_at_the_given_features_and_keep_whole_units():
    assert part(9 * 64, COLUMN, 1, 2, 1, "dense", sizes=(384, 192)) == slice(384, 576)
    assert part(576, ROW, 0, 2, 64, "int4", sizes=(384, 192)) == slice(0, 384)
    with pytest.raises(ValueError, match="multiples of 128"):
        part(576, ROW, 0, 2, 128, "int4", sizes=(384, 192))
    with pytest.raises(ValueError, match="summing to"):
        part(576, ROW, 0, 2, 1, "dense", sizes=(384, 100))


def test_stages_take_consecutive_layers_the_first_ones_one_more():
    assert stage_bounds(30, 2) == [(0, 15), (15, 30)]
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="one decoder layer per stage"):
        stage_bounds(2, 3)


def test_ranks_are_laid_out_stage_major():
    layout = Layout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6
    assert [(layout.stage_of(r), layout.tensor_rank_of(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    ]  # fmt: skip
    assert layout.rank_at(2, 1) == 5


def test_engine_config_refuses_what_runs_in_one_process_only():
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4
    with pytest.raises(ValueError, match="speculative decoding and early exit run in one process"):
        EngineConfig.from_options(tensor_parallel_size=2, speculative="ngram")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="parallel_timeout_s"):
        EngineConfig(parallel_timeout_s=0)
