"""Tiny random llama models for compression tests (float64 where exactness is asserted)."""

import pytest
import torch

from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict

VOCAB = 256


@pytest.fixture
def tiny_model():
    def make(dtype=torch.float32, seed=0, heads=4, kv_heads=2, architecture="llama", vocab=VOCAB):
        import dataclasses

        cfg = dataclasses.replace(
            tiny_config(vocab, architecture), num_attention_heads=heads, num_key_value_heads=kv_heads
        )
        return build_model(cfg, tiny_state_dict(cfg, seed), dtype)

    return make


@pytest.fixture
def calib():
    return torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))


def dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of each sample [S, T] through the calibration runner (the engine's attention path)."""
    from leanlm.compress.calibration import LayerRunner

    runner = LayerRunner(model, ids.shape[1], ids.shape[0])
    h = model.model.embed(ids)
    for layer in model.model.layers:
        h = runner(layer, h)
    return model.compute_logits(model.model.norm(h))
