"""EngineLayout: what the engine says it runs on (the CLI's and the server's start-up line, /metrics) is what it
runs: threads, KV pool, offloaded layers (MoE routing: tests/engine/test_moe_engine.py)."""

from __future__ import annotations

import pytest


@pytest.mark.real_model
def test_the_layout_of_an_offloaded_real_model_names_the_streamed_layers():
    from leanlm import LLM

    llm = LLM(dtype="float32", progress=False, max_weight_memory="200MB", num_threads=1, num_kv_blocks=32)
    layout = llm.llm_engine.layout()
    plan = llm.offloaded.plan
    assert layout.num_streamed_layers == len(plan.streamed_idx) > 0
    assert layout.resident_weight_bytes == plan.resident_bytes
    assert (layout.num_threads, layout.automatic_threads) == (1, False)
    assert (layout.num_kv_blocks, layout.kv_cache_dtype, layout.num_layers) == (32, "float32", 30)
    line = layout.describe()
    resident = 30 - layout.num_streamed_layers
    assert line.startswith("engine: llama, 30 layers, float32 on cpu, 1 thread (fixed); KV cache 32 blocks x 16")
    assert f"weights offloaded: {resident} layers resident" in line and f"{layout.num_streamed_layers} streamed" in line
