"""Training windows: the held-out split, and batches that depend only on (seed, index)."""

import pytest
import torch

from leanlm.train.data import TokenWindows


def test_held_out_windows_are_the_end_of_the_text_and_never_trained_on():
    data = TokenWindows.from_ids(list(range(1000)), 100, held_out=2)
    assert data.train.shape == (8, 100) and data.held_out.shape == (2, 100)
    assert data.held_out[0, 0] == 800 and data.train.max() < 800


def test_each_epoch_visits_every_window_once_in_a_seeded_order():
    data = TokenWindows.from_ids(list(range(600)), 50, held_out=2)  # 10 training windows
    first = torch.cat([data.batch(i, 2, seed=5) for i in range(5)])[:, 0]
    second = torch.cat([data.batch(i, 2, seed=5) for i in range(5, 10)])[:, 0]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 500, 50))
    assert first.tolist() != second.tolist()  # each epoch has its own order
    assert torch.equal(data.batch(3, 2, seed=5), data.batch(3, 2, seed=5))
    assert not torch.equal(torch.cat([data.batch(i, 2, seed=6) for i in range(5)])[:, 0], first)


def test_too_short_a_text_is_a_clear_error():
    with pytest.raises(ValueError, match="shorter --seq-len"):
        TokenWindows.from_ids(list(range(300)), 100, held_out=4)
