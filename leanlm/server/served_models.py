"""ServedModels: the names a server answers to in a request's `model` field: the base model's, and each LoRA adapter
registered with the engine (vLLM's "<adapter>", or "<base>:<adapter>"), as /v1/models lists them."""

from __future__ import annotations

from leanlm.engine import LLMEngine
from leanlm.lora_request import LoRARequest


class ModelNotFoundError(LookupError):
    """A request named a model this server does not serve (OpenAI's 404, model_not_found)."""


class ServedModels:
    def __init__(self, base_names: list[str], engine: LLMEngine) -> None:
        self.base_names = base_names  # what the base model answers to (the first is its name in /v1/models)
        self.engine = engine  # its LoRA manager holds the adapters registered with --lora-modules

    def adapters(self) -> dict[str, LoRARequest]:
        manager = self.engine.lora_manager
        return {} if manager is None else dict(manager.registered)

    def resolve(self, name: str) -> LoRARequest | None:
        """The adapter `name` selects; None for the base model; ModelNotFoundError for anything else."""
        if name in self.base_names:
            return None
        adapters = self.adapters()
        base, _, adapter = name.partition(":")
        found = adapters.get(adapter if adapter and base in self.base_names else name)
        if found is None:
            served = self.base_names + sorted(adapters)
            raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {served}")
        return found

    def listing(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models' entries: the base model's names, then the adapters with the base as their parent."""
        entry = {"object": "model", "created": created, "owned_by": "leanlm", "max_model_len": max_model_len}
        parent = {"parent": self.base_names[0]}
        return [{"id": n, **entry} for n in self.base_names] + [{"id": n, **entry, **parent} for n in self.adapters()]
