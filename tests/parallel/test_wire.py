"""The ranks' wire format: step plans and start-up facts round-trip exactly, and anything else (a pickle, a header
that lies about its tensors, a field too many) is refused with WireError before it becomes a plan."""

from __future__ import annotations

import dataclasses
import pickle
import struct

import pytest
import torch

from leanlm.engine import StepPlan
from leanlm.parallel import wire


def _plan() -> StepPlan:
    return StepPlan(
        input_ids=torch.tensor([5, 17, 99, 3], dtype=torch.long),
        positions=torch.tensor([0, 1, 2, 7], dtype=torch.long),
        query_lens=[3, 1],
        seq_lens=[3, 8],
        block_ids=[[0], [1, 2]],
        blocks_to_copy=[(4, 5)],
        blocks_to_swap_out=[(6, 0)],
        blocks_to_swap_in=[(1, 7)],
        logit_rows=torch.tensor([2, 3], dtype=torch.long),
        num_sample_rows=2,
        expert_subsets=[(0, 3, (1, 4))],
    )


def _fields(plan: StepPlan) -> dict:
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}


def test_plans_round_trip_field_for_field():
    plans = [_plan(), StepPlan.copies_only(_SchedulerOutputStub(), torch.device("cpu"))]
    decoded = wire.decode_plans(wire.encode_plans(plans), torch.device("cpu"))
    assert len(decoded) == 2
    for got, want in zip(decoded, plans, strict=True):
        for name, value in _fields(want).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(got, name), value) and getattr(got, name).dtype == torch.long
            else:
                assert getattr(got, name) == value, name  # tuples come back as tuples
    assert wire.decode_plans(wire.encode_plans(None), torch.device("cpu")) is None
    facts = {"model": "m", "weights": "ab12"}
    assert wire.decode_json(wire.encode_json(facts)) == facts


class _SchedulerOutputStub:
    """What StepPlan.copies_only reads of a SchedulerOutput."""

    blocks_to_copy = [(1, 2)]
    blocks_to_swap_out: list = []
    blocks_to_swap_in = [(3, 4)]


def test_a_pickle_is_refused_not_loaded():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("the wire format unpickled a message",))

    with pytest.raises(wire.WireError):
        wire.decode_plans(pickle.dumps([Boom()]), torch.device("cpu"))
    with pytest.raises(wire.WireError):
        wire.decode_json(pickle.dumps({"model": Boom()}))


def test_headers_that_lie_are_refused():
    good = wire.encode_plans([_plan()])
    cases = {
        "a truncated tensor": good[:-8],
        "bytes beyond the tensors": good + b"\0" * 8,
        "a length prefix past the end": b"\xff" * 8 + good[8:],
        "another dtype": good.replace(b'"int64"', b'"int32"', 1),
        "a field too many": good.replace(b'"num_sample_rows"', b'"num_sample_rowz"', 1),
        "a float where a count goes": good.replace(b'"num_sample_rows":2', b'"num_sample_rows":2.0', 1),
        "deep nesting": struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
    }
    for what, data in cases.items():
        with pytest.raises(wire.WireError):
            wire.decode_plans(data, torch.device("cpu"))
            pytest.fail(f"{what} was accepted")
