"""LeanLM: run, compress and explain transformer language models."""

import os as _os
import sys as _sys

from leanlm.kernels import isa as _isa

# LEANLM_ISA caps PyTorch's kernels too, which read their caps once, when torch loads: before anything imports it.
if "torch" not in _sys.modules:
    _os.environ.update(_isa.torch_environment())
elif _isa.torch_environment():
    import logging as _logging

    _logging.getLogger(__name__).warning(
        "LEANLM_ISA caps our kernels only: torch was imported before leanlm, so its own kernels keep their level "
        "(import leanlm first, or set %s yourself)",
        " and ".join(_isa.torch_environment()),
    )

from leanlm.config import EngineConfig, ModelConfig
from leanlm.pooling_params import PoolingParams
from leanlm.sampling_params import RequestOutputKind, SamplingParams
from leanlm.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "LoRARequest",
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
    if name == "LoRARequest":
        from leanlm.lora_request import LoRARequest

        return LoRARequest
    if name in ("BeamSearchParams", "RequestOutput", "CompletionOutput"):
        from leanlm import engine

        return getattr(engine, name)
    if name in ("Checkpoint", "load_checkpoint", "save_checkpoint"):
        from leanlm import formats

        return getattr(formats, name)
    raise AttributeError(f"module 'leanlm' has no attribute {name!r}")
