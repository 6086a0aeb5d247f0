"""Configuration as frozen dataclasses, validated on construction with messages that say what to do: the model
(model.py), the engine (engine.py), speculative decoding and early exit (decoding.py), long inputs
(long_context.py), the server (serve.py) and its data-parallel router (router.py)."""

from leanlm.config.decoding import EXIT_MEASURES, SPECULATIVE_METHODS, EarlyExitConfig, SpeculativeConfig
from leanlm.config.engine import KV_CACHE_DTYPES, DecodingOptions, EngineConfig
from leanlm.config.long_context import LongContextConfig
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
    "LongContextConfig",
    "ModelConfig",
    "ROUTER_POLICIES",
    "RopeScaling",
    "RouterConfig",
    "ServeConfig",
    "SpeculativeConfig",
    "parse_dtype",
]
