"""LoRAManager: the engine's LoRA adapters (S-LoRA's adapter cache): each name's files read and checked once, before
its first request is queued, kept on the host, and copied into one of max_loras slots when a step runs it; the least
recently used adapter leaves its slot first, never one a running request uses."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import torch

from leanlm.engine.outputs import SchedulerOutput
from leanlm.engine.step_plan import PlannedStep
from leanlm.formats.peft import LoRAAdapter, read_adapter
from leanlm.lora_request import LoRARequest
from leanlm.model.llama import LlamaForCausalLM
from leanlm.model.lora import LoRARun, LoRASlots, install_lora_hooks, lora_target_shapes


class UnknownAdapterError(KeyError):
    """A request named an adapter that was never registered (the server answers 404)."""


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        in_use: Callable[[], set[str]],  # names of the adapters running requests use (their slots stay)
    ) -> None:
        self.model_config = model.config
        self.max_lora_rank = max_lora_rank
        self.slots = LoRASlots(lora_target_shapes(model.config), max_loras, max_lora_rank, dtype, device)
        install_lora_hooks(model)
        self.in_use = in_use
        self.registered: dict[str, LoRARequest] = {}  # name -> its request as first given (its path)
        self.adapters: dict[str, LoRAAdapter] = {}  # name -> read and checked, float32 on the host
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapters in slots, least recently used first
        self.num_loads = 0  # copies into a slot
        self.num_evictions = 0  # adapters that left a slot for another

    def register(self, name: str, path: str) -> LoRARequest:
        """Know `name` as the adapter in `path` (read on first use); the same name for another path is refused."""
        request = LoRARequest(name, path)
        known = self.registered.get(name)
        if known is not None and known.path != request.path:
            raise ValueError(f"adapter {name!r} is already {known.path}; give the adapter in {path} another name")
        self.registered.setdefault(name, request)
        return self.registered[name]

    def resolve(self, name: str) -> LoRARequest:
        """The registered adapter called `name`; UnknownAdapterError otherwise."""
        if name not in self.registered:
            raise UnknownAdapterError(name)
        return self.registered[name]

    def prepare(self, lora: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter of `lora` against the model (once per name, nothing allocated): AdapterError when
        its file does not fit, ValueError when its name was given another path."""
        self.register(lora.name, lora.path)
        if lora.name not in self.adapters:
            self.adapters[lora.name] = read_adapter(lora.path, self.model_config, self.max_lora_rank)
        return self.adapters[lora.name]

    def activate(self, names: list[str]) -> dict[str, int]:
        """Slots for the adapters a step runs (each loaded by `prepare` before), copying in those not held."""
        needed = list(dict.fromkeys(names))
        if len(needed) > self.slots.num_slots:
            raise RuntimeError(f"a step runs {len(needed)} adapters but there are {self.slots.num_slots} slots")
        for name in needed:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            slot = self._free_slot(set(needed) | self.in_use())
            self.slots.set_slot(slot, self.adapters[name].scaled())
            self.slot_of[name] = slot
            self.num_loads += 1
        return {name: self.slot_of[name] for name in needed}

    def _free_slot(self, keep: set[str]) -> int:
        """The lowest empty slot (a step's product spans the slots up to the highest it uses), else the least
        recently used adapter's slot among those not in `keep`."""
        taken = set(self.slot_of.values())
        for slot in range(self.slots.num_slots):
            if slot not in taken:
                return slot
        for name in self.slot_of:
            if name not in keep:
                self.num_evictions += 1
                return self.slot_of.pop(name)
        raise RuntimeError(f"every LoRA slot holds an adapter a running request uses ({sorted(keep)})")

    def attach(self, parts: list[SchedulerOutput], steps: list[PlannedStep]) -> list[PlannedStep]:
        """The planned steps with each request's rows mapped to its adapter's slot (the adapters of all parts are
        placed first: a pipeline's micro-batches run together)."""
        names = [r.lora_request.name for part in parts for r in part.scheduled_requests if r.lora_request is not None]
        if not names:
            return steps
        slot_of = self.activate(names)
        out = []
        for part, step in zip(parts, steps):
            runs, start = [], 0
            for request, n in zip(part.scheduled_requests, part.num_scheduled_tokens):
                lora = request.lora_request
                if lora is not None and lora.scale != 0:
                    runs.append(LoRARun(start, start + n, slot_of[lora.name], lora.scale))
                start += n
            out.append(dataclasses.replace(step, plan=dataclasses.replace(step.plan, lora_runs=tuple(runs))))
        return out
