"""The fallback of last resort keeps one dequantized copy per layer: made once, remade when the codes change, within
a budget (beyond it: per call, as before), given back when freed, and announced once."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from leanlm.model import dense_copy
from leanlm.model.linear.int8 import Int8WeightOnlyLinear


@pytest.fixture
def budget(monkeypatch):
    fresh = dense_copy.DenseCopyBudget()
    monkeypatch.setattr(dense_copy, "BUDGET", fresh)
    return fresh


def _layer() -> Int8WeightOnlyLinear:
    g = torch.Generator().manual_seed(0)
    return Int8WeightOnlyLinear(torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8), torch.rand(48))


def _reference(layer, x):
    return x @ (layer.qweight.float() * layer.scales[:, None]).to(x.dtype).T  # the float32 weight, as stored


def _counting(layer, monkeypatch) -> list:
    calls = []
    original = layer.dequantized_weight
    monkeypatch.setattr(layer, "dequantized_weight", lambda: calls.append(1) or original())
    return calls


def test_one_copy_serves_every_call_until_the_codes_change(budget, monkeypatch, caplog):
    layer = _layer()
    calls = _counting(layer, monkeypatch)
    x = torch.randn(3, 64, dtype=torch.float64)  # no kernel takes float64 anywhere
    with caplog.at_level(logging.WARNING, logger="leanlm.model.dense_copy"):
        first = layer.dense_forward(x)
        layer.dense_forward(x)
    assert len(calls) == 1 and budget.held == 48 * 64 * 8
    assert sum("keeping dequantized copies" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(first, _reference(layer, x))
    with torch.no_grad():
        layer.qweight[0, 0] = -layer.qweight[0, 0] - 1  # an in-place edit bumps the version: a new copy
    torch.testing.assert_close(layer.dense_forward(x), _reference(layer, x))
    assert len(calls) == 2
    layer.dense_forward(x.float())  # another dtype: a new copy in that dtype, the old one given back
    assert len(calls) == 3 and budget.held == 48 * 64 * 4


def test_beyond_the_budget_each_call_dequantizes(budget, monkeypatch):
    monkeypatch.setenv(dense_copy.ENV, "1KiB")
    layer = _layer()
    calls = _counting(layer, monkeypatch)
    x = torch.randn(2, 64, dtype=torch.float64)
    y = layer.dense_forward(x)
    layer.dense_forward(x)
    assert budget.held == 0 and len(calls) == 3  # one refused copy (not asked again), then the reference per call
    torch.testing.assert_close(y, _reference(layer, x))


def test_a_freed_layer_gives_its_bytes_back(budget):
    layer = _layer()
    layer.dense_forward(torch.randn(1, 64, dtype=torch.float64))
    assert budget.held > 0
    del layer
    gc.collect()
    assert budget.held == 0


def test_a_bad_budget_says_what_it_takes(budget, monkeypatch):
    monkeypatch.setenv(dense_copy.ENV, "lots")
    with pytest.raises(ValueError, match="LEANLM_DENSE_COPY_BYTES takes a byte count"):
        _layer().dense_forward(torch.randn(1, 64, dtype=torch.float64))
