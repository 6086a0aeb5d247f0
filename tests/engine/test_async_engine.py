"""AsyncLLMEngine on a tiny engine: streams end with a finished output, closing a stream aborts its request,
capacity is bounded, a failed add fails only its stream, and stop() fails whatever is still open."""

from __future__ import annotations

import asyncio

import pytest

from leanlm.engine import AsyncLLMEngine, EngineStoppedError, QueueFullError
from leanlm.sampling_params import SamplingParams


def _run(make_tiny_engine, scenario, max_queue: int = 4, **engine_options):
    engine = AsyncLLMEngine(make_tiny_engine(**engine_options), max_queue=max_queue)

    async def main():
        engine.start()
        try:
            return await scenario(engine)
        finally:
            engine.stop()

    return engine, asyncio.run(main())


def test_stream_yields_growing_outputs_then_finishes(make_tiny_engine):
    async def scenario(engine):
        outputs = [o async for o in engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
        return outputs

    engine, outputs = _run(make_tiny_engine, scenario)
    # One output per step, unless the reader fell behind (then the newest replaced the unread one).
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 4
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert engine.num_requests_in_flight == 0


def test_a_reader_that_falls_behind_holds_only_the_newest_output(make_tiny_engine):
    """Memory per stream stays O(text): unread cumulative outputs are replaced, not queued (it was one full copy
    of the text per step, O(T^2) for a client that stops reading)."""

    async def scenario(engine):
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
        for _ in range(1000):  # do not read while the request runs to the end
            await asyncio.sleep(0.01)
            if engine.num_requests_in_flight == 0:
                break
        return [o async for o in stream]

    engine, outputs = _run(make_tiny_engine, scenario)
    assert len(outputs) <= 2  # at most one unread non-final output, then the final one
    final = outputs[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 60
    assert final.outputs[0].text == engine.engine.tokenizer.decode(final.outputs[0].token_ids)


def test_closing_a_stream_aborts_and_frees(make_tiny_engine):
    async def scenario(engine):
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        iterator = stream.__aiter__()
        await iterator.__anext__()
        await iterator.aclose()  # what a disconnect does
        for _ in range(200):
            await asyncio.sleep(0.01)
            if engine.num_requests_in_flight == 0:
                break
        return engine.snapshot

    engine, snapshot = _run(make_tiny_engine, scenario)
    llm_engine = engine.engine
    assert engine.num_requests_in_flight == 0 and not llm_engine.has_unfinished_requests()
    assert llm_engine.kv_cache_manager.num_free_blocks == llm_engine.num_kv_blocks
    assert llm_engine.scheduler.stats().num_finished.get("abort") == 1


def test_capacity_counts_sequences_and_rejects_bad_input_at_once(make_tiny_engine):
    async def scenario(engine):
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [engine.add_request([5, 6], long) for _ in range(2)]  # max_num_seqs 2 + max_queue 1 = 3
        with pytest.raises(QueueFullError):
            engine.add_request([5, 6], SamplingParams(n=2))
        streams.append(engine.add_request([5, 6], long))
        with pytest.raises(QueueFullError):
            engine.add_request([5, 6], long)
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("", long)
        for stream in streams:
            stream.abort()
        results = [await s.result() for s in streams]
        return [r.outputs[0].finish_reason for r in results]

    _, reasons = _run(make_tiny_engine, scenario, max_queue=1, max_num_seqs=2)
    assert reasons == ["abort"] * 3


def test_stop_fails_open_streams_and_refuses_new_ones(make_tiny_engine):
    async def scenario(engine):
        stream = engine.add_request([5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
        engine.stop()
        with pytest.raises(EngineStoppedError):
            await stream.result()
        with pytest.raises(EngineStoppedError):
            engine.add_request([5, 6], SamplingParams())
        return engine.is_running

    _, running = _run(make_tiny_engine, scenario)
    assert not running


@pytest.mark.parametrize("max_num_seqs", [4, 8])  # 4: one width-3 search at a time; 8: two at once
def test_beam_searches_run_between_steps_beside_sampling(make_tiny_engine, max_num_seqs):
    from leanlm.engine.beam_search import BeamSearch, BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    async def scenario(engine):
        # Searches start in arrival order while their widths fit max_num_seqs together; the rest wait.
        searches = [engine.add_beam_search(p, params) for p in prompts]
        sampled = engine.add_request([5, 6], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
        return [await s.result() for s in searches], await sampled.result()

    engine, (beam_outputs, sampled) = _run(make_tiny_engine, scenario, max_queue=8, max_num_seqs=max_num_seqs)
    reference = BeamSearch(make_tiny_engine(max_num_seqs=4), params).run(prompts)
    for out, ref in zip(beam_outputs, reference):
        assert out.finished and [c.token_ids for c in out.outputs] == [s.token_ids for s in ref.sequences]
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.prompt_token_ids == ref.prompt_token_ids
    alone = make_tiny_engine(max_num_seqs=4)
    alone.add_request([5, 6], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    from tests.conftest import run_to_completion

    assert sampled.outputs[0].token_ids == next(iter(run_to_completion(alone).values())).outputs[0].token_ids
    llm_engine = engine.engine
    assert llm_engine.stats().num_free_kv_blocks == llm_engine.num_kv_blocks
    assert engine.num_requests_in_flight == 0


def test_aborting_a_beam_search_frees_its_blocks(make_tiny_engine):
    from leanlm.engine.beam_search import BeamSearchParams

    async def scenario(engine):
        stream = engine.add_beam_search([5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=400, ignore_eos=True))
        with pytest.raises(ValueError, match="max_num_seqs"):
            engine.add_beam_search([5, 6], BeamSearchParams(beam_width=5))
        await asyncio.sleep(0.2)  # some rounds run
        stream.abort()
        final = await stream.result()
        return final

    engine, final = _run(make_tiny_engine, scenario, max_num_seqs=4)
    assert final.finished and final.outputs == []
    llm_engine = engine.engine
    assert not llm_engine.has_unfinished_requests() and not llm_engine.scheduler.shared.held
    assert llm_engine.kv_cache_manager.num_free_blocks == llm_engine.num_kv_blocks
    assert all(block.ref_cnt == 0 for block in llm_engine.kv_cache_manager.block_pool.blocks)
