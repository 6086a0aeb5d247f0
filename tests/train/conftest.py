"""Tiny random llama models and a learnable token stream for the training tests."""

import dataclasses

import pytest
import torch

from leanlm.model.llama import build_model
from leanlm.train.data import TokenWindows
from tests.conftest import tiny_config, tiny_state_dict

VOCAB = 256
SEQ_LEN = 32


@pytest.fixture
def tiny_model():
    def make(dtype=torch.float32, seed=0, architecture="llama", kv_heads=2):
        cfg = dataclasses.replace(tiny_config(VOCAB, architecture), num_key_value_heads=kv_heads)
        return build_model(cfg, tiny_state_dict(cfg, seed), dtype)

    return make


@pytest.fixture
def windows():
    """A 50-token phrase repeated: a model can learn it, so the loss has somewhere to go."""
    phrase = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(3))
    return TokenWindows.from_ids(phrase.repeat(120).tolist(), SEQ_LEN)
