"""Fault isolation: a request whose computation raises fails alone; the others in its batch finish with the
same tokens as if it had never been there, and no block (or cached hash) of the failed request survives."""

from __future__ import annotations

import random

from leanlm.engine.beam_search import BeamSearch, BeamSearchParams
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion

POISON = 3  # a token id whose presence in a batch makes the forward raise (checked to be never generated)


def _poison_forward(engine, monkeypatch):
    model = engine.model_runner.model
    real_forward = model.forward

    def forward(input_ids, positions):
        if (input_ids == POISON).any():
            raise RuntimeError("poisoned batch")
        return real_forward(input_ids, positions)

    monkeypatch.setattr(model, "forward", forward)


def _prompts(vocab: int, lengths=(5, 40, 23), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(POISON + 1, vocab) for _ in range(n)] for n in lengths]


def test_a_request_that_raises_fails_alone(make_tiny_engine, tokenizer, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good = _prompts(tokenizer.vocab_size)
    reference = make_tiny_engine()
    for i, prompt in enumerate(good):
        reference.add_request(prompt, params, request_id=f"g{i}")
    expected = {rid: out.outputs[0].token_ids for rid, out in run_to_completion(reference).items()}
    assert not any(POISON in tokens for tokens in expected.values())

    engine = make_tiny_engine(block_size=16)
    _poison_forward(engine, monkeypatch)
    other = _prompts(tokenizer.vocab_size, lengths=(40, 5), seed=1)
    poison_prompt = other[0][:20] + [POISON] + other[0][20:]  # 41 tokens: two full blocks registered, unwritten
    sharer = other[0][:20] + other[1]  # hits the poisoned prompt's first block in the same step
    engine.add_request(good[0], params, request_id="g0")
    engine.add_request(poison_prompt, params, request_id="bad")
    engine.add_request(sharer, params, request_id="sharer")
    for i in (1, 2):
        engine.add_request(good[i], params, request_id=f"g{i}")
    final = run_to_completion(engine)

    bad = final["bad"].outputs[0]
    assert bad.finish_reason == "error" and "poisoned batch" in bad.error and bad.token_ids == []
    assert (
        final["sharer"].outputs[0].finish_reason == "error" and "shared KV blocks" in final["sharer"].outputs[0].error
    )
    assert {rid: final[rid].outputs[0].token_ids for rid in expected} == expected
    assert engine.executor.num_isolations == 1
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == engine.num_kv_blocks
    # The poisoned prompt's blocks were never written: a twin must not hit them in the prefix cache.
    twin = engine.tokenize_prompt(poison_prompt)[1]
    from leanlm.engine.request import Request

    assert kv.get_computed_blocks(Request("twin", twin, params))[1] == 0


def test_a_stop_check_that_raises_fails_its_request_alone(make_tiny_engine, tokenizer, monkeypatch):
    engine = make_tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop=("never-matches",))
    real_check = engine.output_processor.check_stop

    def check_stop(request):
        if request.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_check(request)

    monkeypatch.setattr(engine.scheduler, "stop_checker", check_stop)
    for rid, prompt in zip(("a", "bad", "b"), _prompts(tokenizer.vocab_size)):
        engine.add_request(prompt, params, request_id=rid)
    final = run_to_completion(engine)
    assert final["bad"].outputs[0].finish_reason == "error"
    assert "UnicodeDecodeError" in final["bad"].outputs[0].error
    assert [len(final[r].outputs[0].token_ids) for r in ("a", "b")] == [5, 5]
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_a_batch_error_of_a_lone_request_still_fails_only_it(make_tiny_engine, tokenizer, monkeypatch):
    engine = make_tiny_engine()
    _poison_forward(engine, monkeypatch)
    engine.add_request([POISON + 1, POISON], SamplingParams(max_tokens=3), request_id="bad")
    final = run_to_completion(engine)
    assert final["bad"].outputs[0].finish_reason == "error"
    engine.add_request(
        [POISON + 1, POISON + 2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), request_id="ok"
    )
    assert len(run_to_completion(engine)["ok"].outputs[0].token_ids) == 3


def test_isolated_forks_keep_their_block_copies(make_tiny_engine, tokenizer, monkeypatch):
    """Beam forks that copy-on-write in a batch that raises: each re-run alone carries its own copies, and the
    search ends as it does without the failure."""
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    prompt = _prompts(tokenizer.vocab_size, lengths=(6,))[0]  # 6 tokens: the forks share a half-full block
    (expected,) = BeamSearch(make_tiny_engine(block_size=4), params).run([prompt])

    engine = make_tiny_engine(block_size=4)
    _poison_forward(engine, monkeypatch)
    calls = []
    real_execute = engine.model_runner.execute

    def execute(so):
        calls.append((so.block_ids, so.blocks_to_copy))
        return real_execute(so)

    monkeypatch.setattr(engine.model_runner, "execute", execute)
    search = BeamSearch(engine, params)
    search.add(prompt, 0)
    assert search.step() == []  # the prompt's round; its three forks now hold its blocks
    bad = engine.add_request([POISON] * 3, SamplingParams(max_tokens=2))
    calls.clear()
    outputs = search.step()
    (batch_ids, batch_copies), *alone = calls
    assert len(batch_copies) == 2 and len(alone) == 4  # two forks copy, the third writes in place; + the poison
    for block_ids, copies in alone:
        assert copies == [(src, dst) for src, dst in batch_copies if dst in block_ids[0]]
    assert sorted(c for _, copies in alone for c in copies) == sorted(batch_copies)
    while search.has_unfinished():
        outputs += search.step()
    assert engine.executor.num_isolations == 1
    assert [s.token_ids for s in outputs[0][1].sequences] == [s.token_ids for s in expected.sequences]
    assert bad not in engine.output_processor.parent_ids() and not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
