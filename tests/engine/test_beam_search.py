"""Beam search on copy-on-write shared KV blocks: a fork's logits equal a fresh run; the search equals a plain
reference beam search over dense forwards (no KV cache) and HF transformers' generate(num_beams=...) on a tiny
model, under chunking and preemption; every block is freed after finishing or aborting; the real SmolLM2."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.beam_search import BeamSearch, BeamSearchParams
from leanlm.engine.engine import LLMEngine
from leanlm.engine.request import Request
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4


def dense_reference(config, state_dict):
    """HF's LlamaForCausalLM over the same weights, float64 (the dense forward, used without a cache)."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict())).double().eval()
    hf.load_state_dict(state_dict | {"lm_head.weight": state_dict["model.embed_tokens.weight"]})
    return hf


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """(config, state_dict, hf) of the conftest tiny model, float64."""
    config = tiny_config(tokenizer.vocab_size)
    state_dict = {k: v.double() for k, v in tiny_state_dict(config).items()}
    return config, state_dict, dense_reference(config, state_dict)


def make_engine(tokenizer, config, state_dict, eos_token_id=None, dtype=torch.float64, **options) -> LLMEngine:
    if eos_token_id is not None:
        config = dataclasses.replace(config, eos_token_ids=(eos_token_id,))
    model = build_model(config, state_dict, dtype)
    options = {"block_size": BLOCK_SIZE, "num_kv_blocks": 256} | options
    return LLMEngine(model, tokenizer, EngineConfig(**options), torch.device("cpu"), dtype)


def dense_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """Next-token log-softmax after `token_ids`, from a full forward of the whole sequence (no KV cache)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids]), use_cache=False).logits[0, -1], dim=-1)  # [V]


def reference_beam_search(hf, prompt, width, max_tokens, length_penalty, early_stopping, eos_ids):
    """The textbook loop (HF's rules): every hypothesis recomputed from scratch each step. Returns
    [(score, tokens, cumulative logprob)], best first, and how many hypotheses EOS ended on the way."""
    num_candidates = max(2, 1 + len(eos_ids)) * width
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, list[int], float]] = []
    num_ended_by_eos = 0
    for length in range(1, max_tokens + 1):
        candidates = []
        for tokens, cum in beams:
            top = dense_logprobs(hf, prompt + tokens).topk(num_candidates)
            candidates += [(cum + v, tokens + [t]) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        candidates = sorted(candidates, key=lambda c: -c[0])[:num_candidates]
        beams = []
        for rank, (cum, tokens) in enumerate(candidates):
            if length == max_tokens or tokens[-1] in eos_ids:
                if rank < width:
                    finished.append((cum / length**length_penalty, tokens, cum))
                    num_ended_by_eos += tokens[-1] in eos_ids
            elif len(beams) < width:
                beams.append((tokens, cum))
        finished = sorted(finished, key=lambda f: -f[0])[:width]
        if length == max_tokens or not beams:
            break
        if len(finished) == width and (early_stopping or beams[0][1] / length**length_penalty <= finished[-1][0]):
            break
    return finished, num_ended_by_eos


def random_prompts(vocab_size: int, lengths=(3, 6, 9), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def eos_that_ends_hypotheses(hf, tokenizer, prompt, width, max_tokens, length_penalty, early_stopping) -> int:
    """A token that, made the model's EOS, ends hypotheses of the reference search on this prompt: one of the
    top-2 tokens along greedy decoding, preferably one that ends a returned hypothesis. (The tiny model loops
    on one token, so long hypotheses score well: with length_penalty >= 1 no early end may survive.)"""
    token_ids, tried = list(prompt), []
    for _ in range(max_tokens):
        top = dense_logprobs(hf, token_ids).topk(2).indices.tolist()
        tried += [t for t in top if t not in tried]
        token_ids.append(top[0])
    ending = []
    for eos in tried:
        eos_ids = {eos, *tokenizer.eos_token_ids}
        hypotheses, num_ended = reference_beam_search(
            hf, prompt, width, max_tokens, length_penalty, early_stopping, eos_ids
        )
        if any(tokens[-1] == eos for _, tokens, _ in hypotheses):
            return eos
        if num_ended:
            ending.append(eos)
    assert ending, f"none of {tried} ends a hypothesis; pick another prompt"
    return ending[0]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks
    assert engine.kv_cache_manager._req_to_blocks == {}
    assert engine.scheduler.shared.held == {} and not engine.has_unfinished_requests()


# ---- the fork's KV -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_forked_requests_see_the_same_logits_as_a_fresh_run(tokenizer, tiny, kv_cache_dtype):
    config, state_dict, _ = tiny
    dtype = torch.float64 if kv_cache_dtype == "auto" else torch.float32
    engine = make_engine(tokenizer, config, state_dict, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    prompt = random_prompts(config.vocab_size, lengths=(6,))[0]  # 6 tokens: block 1 is half full
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)
    parent = Request("p", prompt, params, keeps_kv=True)
    engine.add_prepared_request(parent)
    run_to_completion(engine)
    children = []
    for token in (101, 202, 303):
        child = Request(f"c{token}", prompt, dataclasses.replace(params, max_tokens=2))
        child.append_output_token_ids(token)
        engine.fork_request(parent, child, len(prompt))
        children.append(child)
    engine.release_kv("p")
    so = engine.scheduler.schedule()
    # The first two forks copy the shared half-full block 1; the last one has it to itself.
    assert so.block_ids == [[0, 2], [0, 3], [0, 1]] and so.blocks_to_copy == [(1, 2), (1, 3)]
    engine.scheduler.update(so, engine.executor.execute(so))
    for child in children:
        fresh = make_engine(tokenizer, config, state_dict, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        rid = fresh.add_request(prompt + [child.output_token_ids[0]], params)
        expected = run_to_completion(fresh)[rid].outputs[0].logprobs[0]
        got = child.output_logprobs[0]
        assert got.keys() == expected.keys()
        assert max(abs(got[t] - expected[t]) for t in got) < 1e-5
    assert_all_blocks_free(engine)


# ---- the search against references -------------------------------------------------------------------


@pytest.mark.parametrize(
    "width, length_penalty, early_stopping, options, ends_by_eos",
    [
        # ends_by_eos: whether EOS ended a hypothesis on the way for this tiny model (both kinds are covered)
        (2, 1.0, False, {}, True),
        (4, 0.5, False, {"max_num_batched_tokens": 8}, True),  # chunked prefill
        (3, 2.0, True, {}, False),
        (4, -1.0, False, {"num_kv_blocks": 14, "max_num_seqs": 8}, True),  # forks get preempted and recompute
        (2, 0.0, False, {"num_kv_blocks": 10, "enable_prefix_caching": False}, True),  # forks share by ref count only
    ],
)
def test_beam_search_equals_a_dense_reference(
    tokenizer, tiny, width, length_penalty, early_stopping, options, ends_by_eos
):
    config, state_dict, hf = tiny
    prompts = random_prompts(config.vocab_size)
    eos = eos_that_ends_hypotheses(hf, tokenizer, prompts[0], width, 8, length_penalty, early_stopping)
    engine = make_engine(tokenizer, config, state_dict, eos_token_id=eos, **options)
    params = BeamSearchParams(
        beam_width=width, max_tokens=8, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = BeamSearch(engine, params).run(prompts)
    num_stopped = 0
    for prompt, output in zip(prompts, outputs):
        expected, _ = reference_beam_search(
            hf, prompt, width, 8, length_penalty, early_stopping, set(engine.eos_token_ids)
        )
        assert output.prompt_token_ids == prompt
        assert [s.token_ids for s in output.sequences] == [tokens for _, tokens, _ in expected]
        for seq, (_, tokens, cum) in zip(output.sequences, expected):
            # The engine's logprobs are float32 (like HF's beam search), off by ~4e-6 per token.
            assert seq.cumulative_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.score == pytest.approx(seq.cumulative_logprob / len(tokens) ** length_penalty, rel=1e-12)
            assert seq.text == tokenizer.decode(tokens)
            assert seq.finish_reason == ("stop" if tokens[-1] in engine.eos_token_ids else "length")
            num_stopped += seq.finish_reason == "stop"
    assert (num_stopped > 0) == ends_by_eos
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0, "the small pool must preempt forks"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("width, length_penalty, early_stopping", [(2, 1.0, False), (4, 0.0, True), (3, 1.5, False)])
def test_beam_search_equals_hf_generate(tokenizer, tiny, width, length_penalty, early_stopping):
    config, state_dict, hf = tiny
    prompt = random_prompts(config.vocab_size, lengths=(7,), seed=3)[0]
    eos = eos_that_ends_hypotheses(hf, tokenizer, prompt, width, 6, length_penalty, early_stopping)
    engine = make_engine(tokenizer, config, state_dict, eos_token_id=eos)
    params = BeamSearchParams(
        beam_width=width, max_tokens=6, length_penalty=length_penalty, early_stopping=early_stopping
    )
    (output,) = BeamSearch(engine, params).run([prompt])
    eos_ids = list(engine.eos_token_ids)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=6,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert len(output.sequences) == width
    for seq, row, score in zip(output.sequences, ref.sequences.tolist(), ref.sequences_scores.tolist()):
        assert row[len(prompt) : len(prompt) + len(seq.token_ids)] == seq.token_ids
        assert seq.score == pytest.approx(score, abs=1e-4)


def test_ignore_eos_runs_every_hypothesis_to_max_tokens(tokenizer, tiny):
    config, state_dict, hf = tiny
    prompt = random_prompts(config.vocab_size)[0]
    eos = eos_that_ends_hypotheses(hf, tokenizer, prompt, 3, 5, 1.0, False)
    engine = make_engine(tokenizer, config, state_dict, eos_token_id=eos)
    (output,) = BeamSearch(engine, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)).run([prompt])
    expected, _ = reference_beam_search(hf, prompt, 3, 5, 1.0, False, set())
    assert [s.token_ids for s in output.sequences] == [tokens for _, tokens, _ in expected]
    assert all(len(s.token_ids) == 5 and s.finish_reason == "length" for s in output.sequences)


def test_width_one_is_greedy(tokenizer, tiny):
    config, state_dict, _ = tiny
    prompt = random_prompts(config.vocab_size)[1]
    engine = make_engine(tokenizer, config, state_dict)
    (output,) = BeamSearch(engine, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)).run([prompt])
    rid = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert output.sequences[0].token_ids == run_to_completion(engine)[rid].outputs[0].token_ids


# ---- blocks come back ---------------------------------------------------------------------------------


def test_abort_in_the_middle_frees_every_block(tokenizer, tiny):
    config, state_dict, _ = tiny
    engine = make_engine(tokenizer, config, state_dict)
    search = BeamSearch(engine, BeamSearchParams(beam_width=4, max_tokens=10, ignore_eos=True))
    for index, prompt in enumerate(random_prompts(config.vocab_size)):
        search.add(prompt, index)
    pool = engine.kv_cache_manager.block_pool
    max_ref_cnt = 0
    for _ in range(4):
        assert search.step() == []
        max_ref_cnt = max(max_ref_cnt, max(block.ref_cnt for block in pool.blocks))
    assert max_ref_cnt >= 4, "the beams must share their prompt's blocks"
    assert pool.num_free_blocks < pool.num_blocks
    search.abort()
    assert not search.has_unfinished()
    assert_all_blocks_free(engine)


def test_an_interrupted_run_frees_every_block(tokenizer, tiny, monkeypatch):
    config, state_dict, _ = tiny
    engine = make_engine(tokenizer, config, state_dict)
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        BeamSearch(engine, BeamSearchParams(beam_width=3, max_tokens=10)).run(random_prompts(config.vocab_size))
    assert_all_blocks_free(engine)


# ---- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beam_width": 0}, "beam_width must be an integer >= 1"),
        ({"beam_width": 2.0}, "beam_width must be an integer >= 1"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"beam_width": 2, "temperature": 0.7}, "temperature must be 0"),
        ({"beam_width": 2, "early_stopping": "never"}, "early_stopping must be True or False"),
        ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty must be a number in"),
    ],
)
def test_bad_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_bad_search_setups_are_refused(tokenizer, tiny):
    config, state_dict, _ = tiny
    engine = make_engine(tokenizer, config, state_dict, max_num_seqs=4)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        BeamSearch(engine, SamplingParams(n=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        BeamSearch(engine, BeamSearchParams(beam_width=5))
    search = BeamSearch(engine, BeamSearchParams(beam_width=2))
    with pytest.raises(ValueError, match="empty"):
        search.run([[]])
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("penalty", [10.5, -11, 1e308, float("nan"), True])
def test_a_length_penalty_whose_power_overflows_is_refused(penalty):
    """len ** 1e308 overflows a double (a 500 from the server before this check)."""
    with pytest.raises(ValueError, match=r"length_penalty must be a number in \[-10, 10\]"):
        BeamSearchParams(beam_width=2, length_penalty=penalty)
