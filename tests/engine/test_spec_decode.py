"""Speculative decoding in the engine: drafts scheduled as ordinary tokens, greedy output identical to plain
decoding (tiny model against a dense reference, and the real model), the target distribution kept when
sampling, adaptive k, the batch-size switch, and KV blocks all returned."""

from __future__ import annotations

import math
import random

import pytest
import torch

from leanlm.config import EngineConfig, SpeculativeConfig
from leanlm.engine.block_pool import BlockPool
from leanlm.engine.engine import LLMEngine
from leanlm.engine.kv_cache import KVCacheManager
from leanlm.engine.outputs import ModelRunnerOutput
from leanlm.engine.request import Request
from leanlm.engine.scheduler import Scheduler
from leanlm.engine.spec_decode import SpecDecoder
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict
from tests.engine.test_engine import dense_greedy, dense_reference

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _scheduler(num_blocks=16, block_size=4, budget=64, max_model_len=1000):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=budget)
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size), max_model_len, eos_token_ids=[0])


def _prefill_then_draft(sched, request, drafts):
    """Run the prompt, sample token 7 and hand the request `drafts` for its next step."""
    out = sched.schedule()
    sched.update(out, ModelRunnerOutput([[7]], [None], [None], spec_token_ids=[drafts]))


def test_drafts_are_scheduled_as_extra_tokens_and_rejected_ones_uncomputed():
    sched = _scheduler()
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add_request(request)
    _prefill_then_draft(sched, request, [8, 9, 10])
    out = sched.schedule()
    assert out.num_scheduled_tokens == [4] and out.spec_token_ids == [[8, 9, 10]]
    assert request.spec_token_ids == []  # consumed
    # 8 accepted, 9 rejected and replaced by 11: positions 3 (token 7) and 4 (token 8) now have KV
    sched.update(out, ModelRunnerOutput([[8, 11]], [None], [None], spec_token_ids=[[]]))
    assert request.output_token_ids == [7, 8, 11] and request.num_computed_tokens == 5
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (3, 1)


def test_drafts_are_cut_to_what_max_tokens_can_keep():
    sched = _scheduler()
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    sched.add_request(request)
    _prefill_then_draft(sched, request, [8, 9, 10, 11])
    out = sched.schedule()
    # one output exists; two more may come: one accepted draft plus the token sampled after it
    assert out.spec_token_ids == [[8]] and out.num_scheduled_tokens == [2]


def test_drafts_never_cost_a_preemption():
    sched = _scheduler(num_blocks=2, block_size=4)
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=10))
    sched.add_request(request)
    _prefill_then_draft(sched, request, [8, 9, 10, 11, 12])  # would need a third block
    out = sched.schedule()
    assert out.spec_token_ids == [[]] and out.num_scheduled_tokens == [1] and not out.preempted_request_ids


def test_drafts_wait_for_the_whole_remainder():
    sched = _scheduler(budget=2)
    request = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10))
    sched.add_request(request)
    out = sched.schedule()  # 2 of 5 prompt tokens
    sched.update(out, ModelRunnerOutput([[]], [None], [None]))
    request.spec_token_ids = [8, 9]
    out = sched.schedule()  # 3 left, budget 2: drafts cannot follow a partial chunk
    assert out.spec_token_ids == [[]] and out.num_scheduled_tokens == [2]
    sched.update(out, ModelRunnerOutput([[]], [None], [None]))
    request.spec_token_ids = [8, 9]
    out = sched.schedule()  # 1 left: one draft fits the budget
    assert out.spec_token_ids == [[8]] and out.num_scheduled_tokens == [2]


def _spec_engine(make_tiny_engine, *, max_batch_size=8, adaptive=True, **options):
    engine = make_tiny_engine(speculative="ngram", **options)
    config = SpeculativeConfig("ngram", max_batch_size=max_batch_size, adaptive=adaptive)
    engine.model_runner.spec_decoder = SpecDecoder(config)
    return engine


def _draft_engine(tokenizer, noise: float = 0.3, *, adaptive=True, max_batch_size=8, **options) -> LLMEngine:
    """The tiny target with a draft model: its own weights plus noise (accepted often, not always)."""
    config = tiny_config(tokenizer.vocab_size)
    weights = tiny_state_dict(config)
    gen = torch.Generator().manual_seed(5)
    noisy = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in weights.items()}
    target, draft = build_model(config, weights, torch.float64), build_model(config, noisy, torch.float64)
    engine = LLMEngine(
        target,
        tokenizer,
        EngineConfig.from_options(speculative="draft:noisy-copy", **options),
        torch.device("cpu"),
        torch.float64,
        draft,
    )
    runner = engine.model_runner
    config = SpeculativeConfig("draft", draft_model="noisy-copy", adaptive=adaptive, max_batch_size=max_batch_size)
    runner.spec_decoder = SpecDecoder(config, runner.spec_decoder.proposer, runner.block_size, engine.max_model_len)
    return engine


def _repetitive_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    motif = [rng.randrange(3, vocab) for _ in range(7)]
    few = [rng.randrange(3, 12) for _ in range(20)]  # many short matches, most continuations wrong
    return [motif * 4, [rng.randrange(3, vocab) for _ in range(13)], motif * 2 + [rng.randrange(3, vocab)], few]


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "lookahead", "draft", "self"])
def test_greedy_speculation_equals_dense_greedy_under_chunking_and_preemption(make_tiny_engine, tokenizer, proposer):
    options = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=12)
    if proposer == "ngram":
        engine = _spec_engine(make_tiny_engine, **options)
    elif proposer in ("suffix", "lookahead"):
        engine = make_tiny_engine(speculative=proposer, **options)
    elif proposer == "draft":
        engine = _draft_engine(tokenizer, **options)
    else:
        engine = make_tiny_engine(speculative="self:1", **options)
    prompts = _repetitive_prompts(tokenizer.vocab_size)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs = run_to_completion(engine)
    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})
    for request_id, prompt in zip(ids, prompts):
        assert outputs[request_id].outputs[0].token_ids == dense_greedy(hf, prompt, GREEDY.max_tokens)
    stats = engine.model_runner.spec_decoder.stats()
    assert stats.num_draft_tokens > 0
    if proposer == "self":  # the tiny model loops on a token its first layer predicts too: drafts get accepted
        assert stats.num_accepted_tokens > 0
    else:  # both outcomes of verification happened
        assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert engine.scheduler.stats().num_preemptions > 0
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_logprobs_and_stop_conditions_inside_accepted_drafts(make_tiny_engine, tokenizer):
    """Same outputs as the plain engine when max_tokens or a stop string ends a request in the middle of an
    accepted run of drafts, and the same logprobs for every token."""
    prompt = _repetitive_prompts(tokenizer.vocab_size)[0]
    plain = make_tiny_engine(num_kv_blocks=64)
    rid = plain.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    text = tokenizer.decode(run_to_completion(plain)[rid].outputs[0].token_ids[:6])
    stop = text[len(text) // 2 :]
    for params in (
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]),
    ):
        plain = make_tiny_engine(num_kv_blocks=64)
        rid = plain.add_request(prompt, params)
        want = run_to_completion(plain)[rid].outputs[0]
        engine = _spec_engine(make_tiny_engine, adaptive=False, num_kv_blocks=64)
        rid = engine.add_request(prompt, params)
        got = run_to_completion(engine)[rid].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        if params.logprobs:
            for lp_got, lp_want in zip(got.logprobs, want.logprobs, strict=True):
                assert lp_got.keys() == lp_want.keys()
                assert all(abs(lp_got[t] - lp_want[t]) < 1e-9 for t in lp_got)
        assert engine.model_runner.spec_decoder.stats().num_accepted_tokens > 0
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


class FixedProposer:
    """Always drafts the same tokens: exercises verification whatever the context."""

    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, token_ids, k):
        return self.drafts[:k]


@pytest.mark.parametrize("proposer", ["fixed", "draft"])
def test_sampled_speculation_keeps_the_target_distribution(make_tiny_engine, tokenizer, proposer):
    """Token 2 of each request, sampled (temperature 1, top-k 3) through verification of a draft (a fixed token,
    or one the draft model samples from its own q), against the exact conditional distribution from a dense
    float64 forward, per value of token 1."""
    torch.manual_seed(0)  # reproducible draws; the test's power is shown in test_rejection_sampler.py
    num_requests = 600
    options = dict(max_num_seqs=num_requests, num_kv_blocks=num_requests * 3 + 8, max_num_batched_tokens=8192)
    if proposer == "fixed":
        engine = _spec_engine(make_tiny_engine, max_batch_size=num_requests, adaptive=False, **options)
    else:
        engine = _draft_engine(tokenizer, max_batch_size=num_requests, adaptive=False, **options)
    prompt = _repetitive_prompts(tokenizer.vocab_size)[1]
    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})

    def top3(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        values, tokens = logits.topk(3)
        return tokens.tolist(), torch.softmax(values, -1)

    first_tokens, _ = top3(prompt)
    drafts = [top3(prompt + [first_tokens[0]])[0][1], first_tokens[0]]  # a likely token, then an arbitrary one
    if proposer == "fixed":
        engine.model_runner.spec_decoder.proposer.ngram = FixedProposer(drafts)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)  # room for one draft
    ids = [engine.add_request(prompt, params) for _ in range(num_requests)]
    outputs = run_to_completion(engine)
    pairs = [tuple(outputs[i].outputs[0].token_ids[:2]) for i in ids]
    stats = engine.model_runner.spec_decoder.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for t1 in first_tokens:
        seconds = [b for a, b in pairs if a == t1]
        tokens, probs = top3(prompt + [t1])
        counts = torch.tensor([seconds.count(t) for t in tokens], dtype=torch.float64)
        assert counts.sum() == len(seconds)  # nothing outside the top 3
        expected = probs * len(seconds)
        stat = float(((counts - expected) ** 2 / expected).sum())
        assert math.exp(-stat / 2) > 1e-4, (t1, counts.tolist(), expected.tolist())  # chi2 with 2 dof: p = e^(-x/2)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_adaptive_k_follows_acceptance_and_probes_again():
    decoder = SpecDecoder(SpeculativeConfig("ngram", num_speculative_tokens=6, probe_interval=3))
    request = Request("a", [1], SamplingParams())
    assert decoder.num_drafts("a") >= 3  # prior: acceptance 0.6
    for _ in range(10):
        decoder.observe([request], [[1, 2, 3]], [3])
    assert decoder.num_drafts("a") == 6
    for _ in range(30):
        decoder.observe([request], [[1, 2, 3]], [0])
    assert [decoder.num_drafts("a") for _ in range(3)] == [0, 0, 1]  # off, then a probe after 3 steps
    assert [decoder.num_drafts("a") for _ in range(6)] == [0] * 5 + [1]  # it failed: the next waits twice as long
    decoder.forget(["a"])
    assert decoder.num_drafts("a") >= 3


def test_large_batches_and_penalized_requests_do_not_speculate():
    decoder = SpecDecoder(SpeculativeConfig("ngram", max_batch_size=2))
    requests = [Request(str(i), [5, 6, 5], SamplingParams()) for i in range(3)]
    assert decoder.propose(requests, [[6]] * 3) == [[], [], []]
    assert decoder.propose(requests[:2], [[6]] * 2) == [[5, 6], [5, 6]]
    penalized = Request("p", [5, 6, 5], SamplingParams(repetition_penalty=1.2))
    short = Request("m", [5, 6, 5], SamplingParams(min_tokens=3, max_tokens=5))
    assert decoder.propose([penalized, short], [[6], [6]]) == [[], []]


def test_bad_speculative_settings_are_refused():
    with pytest.raises(ValueError, match="unknown speculative method"):
        EngineConfig.from_options(speculative="magic")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig.from_options(speculative="ngram", num_speculative_tokens=0)


_CODE_PROMPT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef"
)
_REAL_PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _exact_verification() -> bool:
    """On the native bf16 kernels a verification row rounds exactly like a decode row."""
    from leanlm.kernels import cpu_decode, cpu_gemv

    return cpu_gemv.is_available() and cpu_decode.is_available()


# Without the native kernels, float32 (torch's GEMM rounds a row by the batch's row count, by an ulp in float32
# but by enough to flip 0.1-nat ties in bf16); text must then agree up to the first tie closer than this.
_FALLBACK_TIE = 0.01


@pytest.fixture(scope="module")
def plain_real_output():
    """Plain greedy tokens of SmolLM2, and the first position whose top-2 margin is a near tie (fallback only)."""
    from leanlm import LLM

    llm = LLM(dtype="bfloat16" if _exact_verification() else "float32", progress=False)
    tokens = llm.generate([_CODE_PROMPT], _REAL_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    prompt = llm.get_tokenizer().encode(_CODE_PROMPT)
    top2 = llm.score([prompt + tokens], use_tqdm=False)[0][len(prompt) - 1 :].topk(2).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    first_tie = next((i for i, m in enumerate(margins) if m < _FALLBACK_TIE), len(tokens))
    return tokens, first_tie


@pytest.mark.parametrize("speculative", ["ngram", "suffix", "lookahead", "self:24", "draft:smollm2-135m-instruct"])
def test_real_model_greedy_speculation_is_token_identical(plain_real_output, speculative):
    """SmolLM2, every proposer: the same tokens as plain greedy decoding. The draft model is SmolLM2 itself, so
    each of its drafts must be accepted (its own KV cache is right). On the native kernels (bfloat16) the whole
    text is identical; on torch's fallback (CPUs without AVX512-BF16) it is identical up to a float32 near tie."""
    from leanlm import LLM

    plain, first_tie = plain_real_output
    exact = _exact_verification()
    llm = LLM(dtype="bfloat16" if exact else "float32", progress=False, speculative=speculative)
    out = llm.generate([_CODE_PROMPT], _REAL_PARAMS, use_tqdm=False)[0].outputs[0]
    if exact:
        assert out.token_ids == plain
    else:
        assert out.token_ids[:first_tie] == plain[:first_tie] and first_tie >= 8, first_tie
    stats = llm.llm_engine.model_runner.spec_decoder.stats()
    assert stats.num_draft_tokens > 0
    if speculative in ("ngram", "suffix", "lookahead"):
        assert stats.num_accepted_tokens > 10
    if speculative.startswith("draft:"):
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_draft_and_self_settings_are_parsed_and_checked(make_tiny_engine):
    with pytest.raises(ValueError, match="draft:MODEL"):
        EngineConfig.from_options(speculative="draft")
    with pytest.raises(ValueError, match="self:K"):
        EngineConfig.from_options(speculative="self:x")
    assert EngineConfig.from_options(speculative="self:3").speculative.num_draft_layers == 3
    assert EngineConfig.from_options(speculative="lookahead").speculative.method == "lookahead"
    assert EngineConfig.from_options(speculative="suffix").speculative.method == "suffix"
    with pytest.raises(ValueError, match="takes no argument"):
        EngineConfig.from_options(speculative="suffix:2")
    with pytest.raises(ValueError, match="takes no argument"):
        EngineConfig.from_options(speculative="lookahead:3")
    assert EngineConfig.from_options(speculative="draft:some/dir").speculative.draft_model == "some/dir"
    with pytest.raises(ValueError, match="first 2 layers"):
        make_tiny_engine(speculative="self:2", num_kv_blocks=16)
    decoder = SpecDecoder(SpeculativeConfig("ngram"))
    requests = [Request(str(i), [5, 6, 5], SamplingParams()) for i in range(2)]
    assert decoder.draft_probs(requests, [[5, 6]] * 2) is None  # prompt lookup: certain drafts


def test_model_drafts_get_lookahead_slots():
    config = EngineConfig.from_options(block_size=4, num_kv_blocks=16, speculative="self:1", num_speculative_tokens=3)
    sched = Scheduler(config, KVCacheManager(BlockPool(16), 4), 1000, eos_token_ids=[0])
    request = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=10))
    sched.add_request(request)
    out = sched.schedule()  # admitted without lookahead: its first drafts stop where its blocks end
    assert len(out.block_ids[0]) == 1
    sched.update(out, ModelRunnerOutput([[7]], [None], [None], spec_token_ids=[[]]))
    out = sched.schedule()  # token 7 at position 4 plus 3 lookahead slots: positions up to 7, two blocks
    assert len(out.block_ids[0]) == 2


@pytest.mark.parametrize("num_kv_blocks", [64, 20])
def test_a_draft_identical_to_the_target_is_always_accepted(tokenizer, num_kv_blocks):
    """The draft's KV is right after catching up lazily, after partial acceptance and after preemption (20
    blocks force it): a draft with the target's own weights proposes exactly the target's greedy tokens."""
    engine = _draft_engine(
        tokenizer, noise=0.0, adaptive=False, block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=12
    )
    for prompt in _repetitive_prompts(tokenizer.vocab_size):
        engine.add_request(prompt, GREEDY)
    run_to_completion(engine)
    stats = engine.model_runner.spec_decoder.stats()
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens
    if num_kv_blocks == 20:
        assert engine.scheduler.stats().num_preemptions > 0
