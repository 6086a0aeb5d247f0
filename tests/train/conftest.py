"""Tiny random llama models and a learnable token stream for the training tests."""

import dataclasses

import pytest
import torch

from leanlm.model.forward import logits
from leanlm.model.llama import build_model
from leanlm.train.data import TokenWindows
from leanlm.train.trainer import Trainer
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


class Interrupt(Exception):
    """Stands for a crash in the middle of a run."""


def run_interrupted(run, at_step: int) -> None:
    """Call run() with the trainer crashing as it begins optimizer step `at_step` (0-based), as a killed run would;
    what it saved before then is what a resumed run starts from."""
    step = Trainer._step

    def crash(self, index):
        if index == at_step:
            raise Interrupt
        return step(self, index)

    Trainer._step = crash
    try:
        with pytest.raises(Interrupt):
            run()
    finally:
        Trainer._step = step


@torch.no_grad()
def teacher_divergence(teacher, student, windows: torch.Tensor) -> float:
    """Mean KL(teacher || student) per position of windows [N, T], over the whole vocabulary."""
    p = torch.log_softmax(logits(teacher, windows), -1)
    q = torch.log_softmax(logits(student, windows), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())
