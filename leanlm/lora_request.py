"""LoRARequest: which adapter one request runs with (vLLM's name; llama.cpp's per-request scale)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter by name: the directory holding adapter_config.json and adapter_model.safetensors, and the
    factor its product is scaled by (on top of the adapter's own lora_alpha / r). Requests naming the same adapter
    share its slot; one name stands for one directory for the engine's lifetime."""

    name: str  # what the engine (and the server's `model` field) calls it
    path: str  # the adapter's directory
    scale: float = 1.0  # 0 runs the base model's outputs; 1 the adapter as trained

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("LoRARequest needs a non-empty name (e.g. LoRARequest('sql', '/path/to/adapter'))")
        if ":" in self.name:
            raise ValueError(f"adapter name {self.name!r} has a ':'; the server reads 'base:adapter' at the first one")
        if isinstance(self.path, Path):
            object.__setattr__(self, "path", str(self.path))
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRARequest {self.name!r} needs the adapter's directory as path")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise ValueError(f"LoRARequest {self.name!r}: scale must be a finite number, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))


def admits_adapter(lora: LoRARequest | None, running: Iterable, max_loras: int) -> bool:
    """Whether a request with adapter `lora` may join the `running` requests (each with a .lora_request): running
    requests use at most max_loras adapters at once, each holding a slot while it runs (the scheduler's LoRA rule)."""
    if lora is None:
        return True
    in_use = {r.lora_request.name for r in running if r.lora_request is not None}
    return lora.name in in_use or len(in_use) < max_loras
