"""LeanLM: run, compress and explain transformer language models."""

from leanlm.config import EngineConfig, ModelConfig
from leanlm.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "CompletionOutput",
    "Checkpoint",
    "load_checkpoint",
    "load_model",
    "save_checkpoint",
]  # compress() lives in leanlm.compress (the subpackage of that name)
__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy imports (torch model code, loaders) only when the API is used.
    if name in ("LLM", "load_model"):
        from leanlm import llm

        return getattr(llm, name)
    if name in ("BeamSearchParams", "RequestOutput", "CompletionOutput"):
        from leanlm import engine

        return getattr(engine, name)
    if name in ("Checkpoint", "load_checkpoint", "save_checkpoint"):
        from leanlm import formats

        return getattr(formats, name)
    raise AttributeError(f"module 'leanlm' has no attribute {name!r}")
