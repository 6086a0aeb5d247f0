"""Tiny checkpoints for the parallel engine's tests: 6 heads in 3 KV groups (they split 4 + 2 over 2 ranks) and 3
layers (2 + 1 over 2 stages); dense, int4 and 2:4 (each format shards through its own unit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leanlm.compress import MagnitudeConfig, RTNConfig, compress
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.native import save_checkpoint
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


def _tiny_checkpoint(path, tokenizer, recipe=None):
    config = dataclasses.replace(
        tiny_config(tokenizer.vocab_size),
        hidden_size=192,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
        intermediate_size=256,
        num_hidden_layers=3,
    )
    model = build_model(config, tiny_state_dict(config, seed=4), torch.float32)
    if recipe is not None:
        compress(model, recipe, progress=False)
    save_checkpoint(Checkpoint(model, tokenizer), path, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="session")
def parallel_checkpoints(tmp_path_factory):
    from tests.tiny_tokenizer import tiny_tokenizer

    tokenizer, root = tiny_tokenizer(), tmp_path_factory.mktemp("parallel")
    return {
        "dense": _tiny_checkpoint(root / "dense", tokenizer),
        "int4": _tiny_checkpoint(root / "int4", tokenizer, [RTNConfig(bits=4, group_size=32)]),
        "2:4": _tiny_checkpoint(root / "sparse", tokenizer, [MagnitudeConfig(pattern="2:4")]),
    }
