"""The engine's public surface: everything outside leanlm/engine/ imports from here, never from its modules.

LLMEngine (requests in, outputs out, stats), AsyncLLMEngine (the asyncio bridge the server uses), beam search,
and the output types. The scheduler, model runner, KV bookkeeping and proposers behind them are internals.
"""

from leanlm.engine.async_engine import AsyncLLMEngine, EngineSnapshot
from leanlm.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from leanlm.engine.engine import EngineStats, LLMEngine
from leanlm.engine.errors import EngineStoppedError, QueueFullError, RequestFailedError
from leanlm.engine.outputs import CompletionOutput, RequestOutput
from leanlm.engine.request_stream import RequestStream

__all__ = [
    "AsyncLLMEngine",
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineSnapshot",
    "EngineStats",
    "EngineStoppedError",
    "LLMEngine",
    "QueueFullError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
]
