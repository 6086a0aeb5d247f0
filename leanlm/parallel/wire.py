"""The bytes the ranks of a parallel engine send each other: a step's plans (a JSON header with every list and count,
then the tensors' raw bytes as the header describes them: name, dtype, shape) and the start-up facts (JSON). No
pickles: what comes off the network is data, never code, and it is checked before it becomes a StepPlan."""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import torch

from leanlm.engine import StepPlan

MAX_MESSAGE_BYTES = 1 << 30  # a step of the largest batch is a few MB; more is a broken or hostile peer
_HEADER_LENGTH = struct.Struct("<Q")  # the JSON header's byte length, before it
_TENSOR_FIELDS = ("input_ids", "positions", "logit_rows")  # StepPlan's tensors: 1-D int64 (token ids, rows)
_INT_LIST_FIELDS = ("query_lens", "seq_lens")
_PAIR_FIELDS = ("blocks_to_copy", "blocks_to_swap_out", "blocks_to_swap_in", "pool_segments")  # lists of (int, int)
# Every StepPlan field has a rule here; a field added to StepPlan without one fails encode_plans (and its test).
_OTHER_FIELDS = ("block_ids", "num_sample_rows", "expert_subsets")
# Fields that never cross: they must be empty (LoRA runs in one process: EngineConfig refuses enable_lora on a parallel
# engine, whose other ranks hold no adapter slots)
_LOCAL_FIELDS = ("lora_runs",)
_FIELDS = frozenset((*_TENSOR_FIELDS, *_INT_LIST_FIELDS, *_PAIR_FIELDS, *_OTHER_FIELDS, *_LOCAL_FIELDS))


class WireError(ValueError):
    """A message from another rank that is not what this protocol sends (a broken or hostile peer)."""


def encode_plans(plans: list[StepPlan] | None) -> bytes:
    """One step's plans (None: shut down) as bytes; the tensors go over as their raw little-endian bytes."""
    if plans is None:
        return _frame({"plans": None}, [])
    headers, blobs = [], []
    for plan in plans:
        names = {f.name for f in dataclasses.fields(plan)}
        if names != _FIELDS:
            raise TypeError(f"StepPlan's fields {sorted(names ^ _FIELDS)} have no wire rule; add one in wire.py")
        if plan.lora_runs:
            raise TypeError("a parallel engine's plans carry no LoRA runs: adapters run in one process")
        header: dict[str, Any] = {"tensors": []}
        for name in _TENSOR_FIELDS:
            tensor = getattr(plan, name).detach().to("cpu", torch.int64).contiguous()
            header["tensors"].append([name, "int64", list(tensor.shape)])
            blobs.append(tensor.numpy().tobytes())
        for name in (*_INT_LIST_FIELDS, *_PAIR_FIELDS, "block_ids", "num_sample_rows"):
            header[name] = getattr(plan, name)
        header["expert_subsets"] = [[start, end, list(experts)] for start, end, experts in plan.expert_subsets]
        headers.append(header)
    return _frame({"plans": headers}, blobs)


def decode_plans(data: bytes, device: torch.device) -> list[StepPlan] | None:
    """encode_plans' bytes back as StepPlans on `device`; WireError if they are not exactly such bytes."""
    message, body = _unframe(data)
    if set(message) != {"plans"}:
        raise WireError(f"a step message has keys {sorted(message)}, not ['plans']")
    if message["plans"] is None:
        return None
    if not isinstance(message["plans"], list):
        raise WireError("a step message's plans are not a list")
    plans, offset = [], 0
    for header in message["plans"]:
        if not isinstance(header, dict) or set(header) != (_FIELDS - {*_TENSOR_FIELDS, *_LOCAL_FIELDS}) | {"tensors"}:
            raise WireError("a step plan's header does not have StepPlan's fields")
        fields: dict[str, Any] = {}
        tensors = header["tensors"]
        if not isinstance(tensors, list) or [t[0] if isinstance(t, list) and t else None for t in tensors] != list(
            _TENSOR_FIELDS
        ):
            raise WireError(f"a step plan's tensors must be {list(_TENSOR_FIELDS)}, in order")
        for name, dtype, shape in tensors:
            if dtype != "int64" or not (isinstance(shape, list) and len(shape) == 1 and _is_count(shape[0])):
                raise WireError(f"step plan tensor {name} must be 1-D int64, got {dtype} {shape}")
            size = shape[0] * 8
            if offset + size > len(body):
                raise WireError(f"step plan tensor {name} runs past the end of the message")
            chunk = bytearray(body[offset : offset + size])  # writable: torch.frombuffer shares it
            fields[name] = torch.frombuffer(chunk, dtype=torch.int64).to(device) if size else _empty(device)
            offset += size
        for name in _INT_LIST_FIELDS:
            fields[name] = _int_list(header[name], name)
        for name in _PAIR_FIELDS:
            fields[name] = [tuple(_int_list(pair, name, length=2)) for pair in _list(header[name], name)]
        fields["block_ids"] = [_int_list(ids, "block_ids") for ids in _list(header["block_ids"], "block_ids")]
        if not _is_count(header["num_sample_rows"]):
            raise WireError("num_sample_rows must be a count")
        fields["num_sample_rows"] = header["num_sample_rows"]
        subsets = []
        for subset in _list(header["expert_subsets"], "expert_subsets"):
            if not (isinstance(subset, list) and len(subset) == 3):
                raise WireError("an expert subset must be [first row, end row, experts]")
            start, end = _int_list(subset[:2], "expert_subsets", length=2)
            subsets.append((start, end, tuple(_int_list(subset[2], "expert_subsets"))))
        fields["expert_subsets"] = subsets
        plans.append(StepPlan(**fields))
    if offset != len(body):
        raise WireError(f"a step message has {len(body) - offset} bytes its header does not describe")
    return plans


def encode_json(value: Any) -> bytes:
    return _frame(value, [])


def decode_json(data: bytes) -> Any:
    value, body = _unframe(data)
    if body:
        raise WireError("a JSON message carries trailing bytes")
    return value


def _frame(header: Any, blobs: list[bytes]) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([_HEADER_LENGTH.pack(len(text)), text, *blobs])


def _unframe(data: bytes) -> tuple[Any, memoryview]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES} a rank accepts")
    if len(data) < _HEADER_LENGTH.size:
        raise WireError("a message shorter than its length prefix")
    (length,) = _HEADER_LENGTH.unpack_from(data)
    end = _HEADER_LENGTH.size + length
    if end > len(data):
        raise WireError("a message's header runs past its end")
    try:
        header = json.loads(bytes(data[_HEADER_LENGTH.size : end]))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"a message's header is not JSON ({exc})") from None
    return header, memoryview(data)[end:]


def _empty(device: torch.device) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long, device=device)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise WireError(f"{name} must be a list")
    return value


def _int_list(value: Any, name: str, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise WireError(f"{name} must hold lists of integers")
    if length is not None and len(value) != length:
        raise WireError(f"{name} must hold lists of {length} integers")
    return value
