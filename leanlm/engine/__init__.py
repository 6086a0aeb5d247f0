"""The engine's public surface: everything outside leanlm/engine/ imports from here, never from its modules.

LLMEngine (requests in, outputs out, stats), AsyncLLMEngine (the asyncio bridge the server uses), beam search,
and the output types. The scheduler, KV bookkeeping and proposers behind them are internals. ModelRunner and
StepPlan are public for the ranks of a parallel engine (leanlm.parallel), which run steps' forwards without a
scheduler of their own.
"""

from leanlm.engine.async_engine import AsyncLLMEngine, EngineSnapshot
from leanlm.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from leanlm.engine.engine import EngineStats, LLMEngine
from leanlm.engine.errors import EngineDeadError, EngineStoppedError, QueueFullError, RequestFailedError
from leanlm.engine.layout import EngineLayout
from leanlm.engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from leanlm.engine.outputs import CompletionOutput, RequestOutput
from leanlm.engine.request_stream import RequestStream
from leanlm.engine.step_plan import StepOutput, StepPlan

__all__ = [
    "AsyncLLMEngine",
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineDeadError",
    "EngineLayout",
    "EngineSnapshot",
    "EngineStats",
    "EngineStoppedError",
    "LLMEngine",
    "ModelRunner",
    "QueueFullError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "StepOutput",
    "StepPlan",
    "kv_cache_bytes_per_block",
]
