"""The batched, paged, chunked, preempted engine against a plain dense forward (HF, float64), tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

transformers = pytest.importorskip("transformers")


def dense_reference(config, state_dict):
    """HF's LlamaForCausalLM over the same weights, float64."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict())).double().eval()
    hf.load_state_dict(state_dict | {"lm_head.weight": state_dict["model.embed_tokens.weight"]})
    return hf


def dense_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding: the whole sequence recomputed each step, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 40, 9)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(5)], shared + [rng.randrange(3, vocab)]]
    return prompts


def test_engine_matches_dense_forward_under_chunking_prefix_hits_and_preemption(make_tiny_engine, tokenizer):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)
    prompts = _prompts(tokenizer.vocab_size)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = run_to_completion(engine)

    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})
    for request_id, prompt in zip(ids, prompts):
        assert outputs[request_id].outputs[0].token_ids == dense_greedy(hf, prompt, 20), request_id
    stats = engine.scheduler.stats()
    assert stats.num_preemptions > 0, "the tiny pool must force preemption"
    assert engine.kv_cache_manager.prefix_cache_hits > 0, "the shared prefix must hit the cache"
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_batched_equals_alone_and_blocks_are_freed(make_tiny_engine, tokenizer):
    prompts = _prompts(tokenizer.vocab_size, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = make_tiny_engine(block_size=16, num_kv_blocks=64)
    ids = [batched.add_request(p, params) for p in prompts]
    together = run_to_completion(batched)
    for request_id, prompt in zip(ids, prompts):
        alone = make_tiny_engine(block_size=16, num_kv_blocks=64)
        rid = alone.add_request(prompt, params)
        assert run_to_completion(alone)[rid].outputs[0].token_ids == together[request_id].outputs[0].token_ids
    assert batched.kv_cache_manager.num_free_blocks == 64


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_tiny_engine, tokenizer):
    prompts = _prompts(tokenizer.vocab_size, seed=2)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    other = SamplingParams(max_tokens=10, temperature=1.0)
    engine = make_tiny_engine(dtype=torch.float32)
    rid = engine.add_request(prompts[0], seeded)
    alone = run_to_completion(engine)[rid].outputs[0].token_ids
    engine = make_tiny_engine(dtype=torch.float32)
    for p in prompts[1:3]:
        engine.add_request(p, other)
    rid = engine.add_request(prompts[0], seeded)
    for p in prompts[3:]:
        engine.add_request(p, other)
    assert run_to_completion(engine)[rid].outputs[0].token_ids == alone


def test_n_completions_share_the_prompt_and_differ(make_tiny_engine, tokenizer):
    engine = make_tiny_engine(dtype=torch.float32)
    rid = engine.add_request(
        _prompts(tokenizer.vocab_size)[2], SamplingParams(n=3, max_tokens=8, seed=7, ignore_eos=True)
    )
    out = run_to_completion(engine)[rid]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in out.outputs)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks  # sharing: test_parallel_sampling.py


def test_stop_string_spanning_tokens(make_tiny_engine, tokenizer):
    prompt = _prompts(tokenizer.vocab_size)[0]  # its greedy tokens are text (some random ones are lone bytes)
    engine = make_tiny_engine()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    full = run_to_completion(engine)[rid].outputs[0]
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]

    def spans(i: int) -> bool:  # token i's text ends with 2+ characters and token i + 1 adds 2+ more
        end = len(pieces[i])
        return (
            end >= 2
            and len(pieces[i + 1]) >= end + 2
            and full.text.startswith(pieces[i + 1])
            and full.text.find(full.text[end - 2 : end + 2]) == end - 2
        )

    # a stop string made of the end of token j's text and the start of token j + 1's
    j = next(i for i in range(len(pieces) - 1) if spans(i))
    boundary = len(pieces[j])
    stop = full.text[boundary - 2 : boundary + 2]
    engine = make_tiny_engine()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    out = run_to_completion(engine)[rid].outputs[0]
    assert out.text == full.text[: boundary - 2]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: j + 2]


def test_logprobs_match_the_dense_reference(make_tiny_engine, tokenizer):
    prompt = _prompts(tokenizer.vocab_size)[0]
    engine = make_tiny_engine()
    rid = engine.add_request(
        prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    )
    out = run_to_completion(engine)[rid]
    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], -1)  # [len, V]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert prompt[j] in entry and len(entry) >= 2
        assert entry[prompt[j]] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        position = len(prompt) + i - 1
        assert token in entry and len(entry) == 4  # greedy: the chosen token is the top one
        top = ref[position].topk(4)
        assert sorted(entry) == sorted(top.indices.tolist())
        assert entry[token] == pytest.approx(float(top.values[0]), abs=1e-4)


def test_full_prompt_logprobs_cover_every_chunk_and_match_the_dense_reference(make_tiny_engine, tokenizer):
    prompt = _prompts(tokenizer.vocab_size)[2]  # 40 tokens, scheduled in chunks of 16
    engine = make_tiny_engine(max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, full_prompt_logprobs=True)
    rid = engine.add_request(prompt, params)
    out = run_to_completion(engine)[rid]
    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)[:-1]  # [P-1, V]
    full = out.prompt_logprobs_full
    assert full.shape == ref.shape and full.dtype == torch.float32 and full.device.type == "cpu"
    assert torch.allclose(full.double(), ref, atol=1e-4)
    for j in range(1, len(prompt)):
        assert out.prompt_logprobs[j][prompt[j]] == pytest.approx(float(full[j - 1, prompt[j]]), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must be"),
        (dict(stop_token_ids=[2, -1]), "stop_token_ids must be token ids"),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_fail_alone(make_tiny_engine, tokenizer):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=8, max_model_len=64)
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="context holds 64"):
        engine.add_request(list(range(3, 67)), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, tokenizer.vocab_size + 5], SamplingParams())
    with pytest.raises(ValueError, match=r"stop_token_ids \[1099511627776\] are outside the vocabulary"):
        engine.add_request([5, 6], SamplingParams(stop_token_ids=[2, 2**40]))
    with pytest.raises(ValueError, match="stop_token_ids .* outside the vocabulary"):
        engine.add_request([5, 6], SamplingParams(stop_token_ids=[tokenizer.vocab_size + 5]))
    with pytest.raises(ValueError, match="needs 11 KV blocks but the cache has 8"):
        engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=4))  # fits the context, not the pool
    # its prompt fits the pool, but it outgrows the pool while generating: fails alone, the other finishes
    too_big = engine.add_request(list(range(3, 33)), SamplingParams(max_tokens=10, ignore_eos=True))
    outputs = run_to_completion(engine)
    assert outputs[too_big].outputs[0].finish_reason == "error"
    assert outputs[good].outputs[0].finish_reason in ("length", "stop")
    assert engine.kv_cache_manager.num_free_blocks == 8


def test_abort_frees_blocks(make_tiny_engine):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=32)
    keep = engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=6, temperature=0.0))
    drop = engine.add_request(list(range(40, 60)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    engine.step()
    out = engine.abort_request(drop)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert run_to_completion(engine)[keep].outputs[0].finish_reason == "length"
    assert engine.kv_cache_manager.num_free_blocks == 32


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_is_the_same_under_chunking_prefix_hits_and_preemption(
    make_tiny_engine, tokenizer, kv_cache_dtype
):
    """An 8-bit cache is read exactly as written, so schedule shape changes nothing: the chunked, prefix-cached,
    preempted batch gives each prompt the tokens it gets alone, prefilled whole in a roomy cache."""
    prompts = _prompts(tokenizer.vocab_size)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = make_tiny_engine(
        block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=6, kv_cache_dtype=kv_cache_dtype
    )
    assert engine.model_runner.kv_cache.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = run_to_completion(engine)
    assert engine.scheduler.stats().num_preemptions > 0, "the tiny pool must force preemption"
    assert engine.kv_cache_manager.prefix_cache_hits > 0, "the shared prefix must hit the cache"
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    config = tiny_config(tokenizer.vocab_size)
    hf = dense_reference(config, {k: v.double() for k, v in tiny_state_dict(config).items()})
    num_agree = 0
    for request_id, prompt in zip(ids, prompts):
        alone = make_tiny_engine(
            block_size=16, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False
        )
        rid = alone.add_request(prompt, params)
        tokens = outputs[request_id].outputs[0].token_ids
        assert run_to_completion(alone)[rid].outputs[0].token_ids == tokens, request_id
        num_agree += tokens[:4] == dense_greedy(hf, prompt, 4)
    assert num_agree >= len(prompts) - 1  # and the 8-bit cache still follows the float model


def test_kv_pool_capacity_counts_values_and_scales(make_tiny_engine):
    budget = 1 << 20
    # tiny model: L=2, Hkv=2, D=16, block_size=16; float64 K/V vs int8 K/V + one float32 scale per (token, head)
    float_engine = make_tiny_engine(kv_cache_memory_bytes=budget)
    int8_engine = make_tiny_engine(kv_cache_memory_bytes=budget, kv_cache_dtype="int8")
    float_block = 2 * 2 * 16 * 2 * 16 * 8
    int8_block = 2 * 2 * 16 * 2 * (16 * 1 + 4)
    assert float_engine.num_kv_blocks == budget // float_block == 64
    assert int8_engine.num_kv_blocks == budget // int8_block == 409
    assert int8_engine.kv_capacity_tokens == 409 * 16
    runner = int8_engine.model_runner
    assert runner.kv_cache.scales.shape == (2, 2, 409, 2, 16) and runner.kv_cache.scales.dtype == torch.float32
    assert runner.kv_cache_bytes == 409 * int8_block <= budget


def test_the_n_children_of_a_request_share_one_parameter_object(make_tiny_engine):
    engine = make_tiny_engine()
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=3, stop_token_ids=tuple(range(100, 300)))
    request_id = engine.add_request([5, 6, 7], params)
    children = [engine.scheduler.requests[cid] for cid in engine.output_processor.child_ids(request_id)]
    assert len(children) == 4 and all(child.sampling_params is params for child in children)
    # Seeded siblings still draw from seed + i.
    firsts = [child.generator.initial_seed() for child in children]
    assert firsts == [7, 8, 9, 10]
