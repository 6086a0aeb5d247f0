"""Configuration as frozen dataclasses, validated on construction with messages that say what to do: the model
(model.py), the engine and speculative decoding (engine.py), the server (serve.py) and its
data-parallel router (router.py)."""

from leanlm.config.engine import (
    EXIT_MEASURES,
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    DecodingOptions,
    EarlyExitConfig,
    EngineConfig,
    SpeculativeConfig,
)
from leanlm.config.model import (
    DTYPES,
    MAX_POSITION_EMBEDDINGS,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    parse_dtype,
)
from leanlm.config.router import ROUTER_POLICIES, RouterConfig
from leanlm.config.serve import ServeConfig

__all__ = [
    "DTYPES",
    "KV_CACHE_DTYPES",
    "MAX_POSITION_EMBEDDINGS",
    "SPECULATIVE_METHODS",
    "SUPPORTED_ARCHITECTURES",
    "EXIT_MEASURES",
    "DecodingOptions",
    "EarlyExitConfig",
    "EngineConfig",
    "ModelConfig",
    "ROUTER_POLICIES",
    "RopeScaling",
    "RouterConfig",
    "ServeConfig",
    "SpeculativeConfig",
    "parse_dtype",
]
