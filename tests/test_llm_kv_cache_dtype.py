"""8-bit KV caches (int8, fp8) on the real bundled model (SmolLM2-135M-Instruct, its GGUF dequantized to bfloat16,
the weights the thresholds below were measured on) against the unquantized cache: the same greedy text up to
near-ties, close next-token distributions, and batching/chunking/prefix hits that change nothing."""

from __future__ import annotations

import pytest
import torch

from leanlm import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
COMPLETIONS = [
    "Once upon a time, in a small village,",
    "The main causes of the French Revolution were",
    "import numpy as np\n\ndef mean(values):",
    "Water boils at",
]
QUESTIONS = ["What is the capital of France?", "List three primary colors.", "What is 7 plus 5?"]
NUM_TOKENS = 24
NEAR_TIE = 0.5  # nats between the reference's top two tokens: below this, either pick is right

pytestmark = pytest.mark.real_model  # the bundled model throughout


@pytest.fixture(scope="module")
def auto_llm():
    return LLM(MODEL, dtype="bfloat16", progress=False, dequantize_gguf=True)


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def quant_llm(request):
    return LLM(MODEL, dtype="bfloat16", progress=False, dequantize_gguf=True, kv_cache_dtype=request.param)


@pytest.fixture(scope="module")
def reference(auto_llm):
    """Each prompt + its greedy continuation with the unquantized cache, and that cache's scores of it."""
    tok = auto_llm.get_tokenizer()
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [tok.encode(t) for t in COMPLETIONS]
    outputs = auto_llm.generate(prompts, params, use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs)]
    return prompts, sequences, auto_llm.score(sequences, use_tqdm=False)


def test_greedy_text_and_distributions_match_the_unquantized_cache(quant_llm, reference):
    prompts, sequences, ref_scores = reference
    quant_scores = quant_llm.score(sequences, use_tqdm=False)  # teacher-forced on the reference continuation
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    generated = [o.outputs[0].token_ids for o in quant_llm.generate(prompts, params, use_tqdm=False)]
    for prompt, seq, ref, got, tokens in zip(prompts, sequences, ref_scores, quant_scores, generated):
        ref, got = ref[len(prompt) - 1 :], got[len(prompt) - 1 :]  # [NUM_TOKENS, V]: rows scoring the continuation
        kl = (ref.exp() * (ref - got)).sum(-1)  # KL(unquantized || 8-bit) per position
        assert kl.mean() < 0.02 and kl.max() < 0.1, (kl.mean(), kl.max())  # measured: int8 ~0.002, fp8 ~0.005
        top2 = ref.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > NEAR_TIE
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])  # the same pick wherever it is clear
        # Free-running greedy text is the reference's up to its first near-tie (and all of it when there is none).
        continuation = seq[len(prompt) :]
        first_tie = next((i for i in range(NUM_TOKENS) if not clear[i]), NUM_TOKENS)
        assert tokens[:first_tie] == continuation[:first_tie], (first_tie, tokens)
    greedy_agree = [
        next((i for i, (a, b) in enumerate(zip(t, s[len(p) :])) if a != b), NUM_TOKENS)
        for p, s, t in zip(prompts, sequences, generated)
    ]
    assert sum(n >= 16 for n in greedy_agree) >= 2, greedy_agree  # most prompts: 16+ identical tokens


# Schedule noise: float32 GEMMs and SDPA round a row differently with the batch's shape (F.linear's row 0 with
# M = 1, 2-3 and >= 4 rows differs in ~1,400 of 1,536 outputs by an ulp on MKL 2024.2), so no cache is exactly
# schedule-invariant end to end. A 16-bit cache carries that ulp (measured max |d logprob| 1.4e-5): a fixed bound.
# An 8-bit cache turns the ulp into a whole quantization step wherever a value sits on a rounding boundary, and
# from the first such flip on, every later layer's K/V differ by far more than an ulp, so flips cascade: the two
# schedules end up as two independent draws of the quantization error, whose size depends on the CPU's rounding
# (fp8 e4m3's top-binade step is 7% of a row's absmax against int8's 0.8%: measured max KL 4e-3 on Zen 5, 0.0295
# on a Xeon). No K/V is read unquantized by one schedule and quantized by the other (store_kv returns what the cache
# holds), and the attention is exact given the same K/V (tests/model/test_attention_schedule.py): so the bound is
# derived from each run's own quantization error against the float cache. With KL ~ |delta|^2 in the Fisher norm,
# |a - b|^2 <= (|a| + |b|)^2 <= 4 max(|a|^2, |b|^2): over a sequence, KL(alone || batched) is at most 4x the largest
# KL(float || alone) or KL(float || batched) (measured on Zen 3: at most 0.28x). That bound means something only if
# the batched run's own error is the size of the alone run's (two draws of one error process), which a wrong block,
# scale or chunk boundary would break: its mean KL against the float cache is at most twice the alone run's.
SCHEDULE_BOUNDS = {"auto": (1e-6, 1e-3), "int8": (None, 0.25), "fp8_e4m3": (None, 0.25)}  # (max KL, max |d lp|)


def _kl(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    return (ref.exp() * (ref - got)).sum(-1)  # [T-1]: KL(ref || got) per position


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_batched_chunked_prefix_cached_matches_alone(kv_cache_dtype):
    """Same kv_cache_dtype, two schedules: all prompts at once in 32-token chunks sharing the chat template's
    cached prefix, vs each prompt alone in a fresh engine prefilled whole. float32 compute, as in test_llm. The
    distributions agree within the schedule noise above, and greedy text agrees up to the first near tie."""
    max_kl, max_diff = SCHEDULE_BOUNDS[kv_cache_dtype]
    # float weights dequantized at load (the GGUF codes' numbers, without a dequantization per product)
    options = dict(dtype="float32", progress=False, dequantize_gguf=True)
    alone_llm = LLM(MODEL, **options, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    tok = alone_llm.get_tokenizer()
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ] + [tok.encode(t) for t in COMPLETIONS[:2]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    batched = LLM(MODEL, **options, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32, block_size=8)
    together = [o.outputs[0].token_ids for o in batched.generate(prompts, params, use_tqdm=False)]
    assert batched.llm_engine.stats().scheduler.prefix_cache_hit_rate > 0
    alone = [alone_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    sequences = [p + a for p, a in zip(prompts, alone)]
    batched_scores = batched.score(sequences, use_tqdm=False)  # one batch, chunked, prefix hits
    float_llm = None if max_kl is not None else LLM(MODEL, **options, enable_prefix_caching=False)
    for prompt, seq, got, mine, theirs in zip(prompts, sequences, batched_scores, alone, together):
        ref = alone_llm.score([seq], use_tqdm=False)[0]  # [T-1, V]: the sequence alone, prefilled whole
        kl = _kl(ref, got)
        if float_llm is None:
            assert kl.max() <= max_kl, kl.max()
        else:  # each run's own quantization error bounds the schedule difference (derivation above)
            exact = float_llm.score([seq], use_tqdm=False)[0]  # the float cache, alone
            quant_kl = torch.stack([_kl(exact, ref), _kl(exact, got)])  # [2, T-1]
            assert quant_kl[1].mean() <= 2 * quant_kl[0].mean() + 1e-3, quant_kl.mean(-1)
            assert kl.max() <= 4 * quant_kl.max(), (kl.max(), quant_kl.max())
        assert (got - ref).gather(-1, ref.argmax(-1, keepdim=True)).abs().max() <= max_diff
        top2 = ref[len(prompt) - 1 :].topk(2).values
        first_tie = next((i for i, m in enumerate((top2[:, 0] - top2[:, 1]).tolist()) if m < 2 * max_diff), 16)
        assert theirs[:first_tie] == mine[:first_tie], (first_tie, mine, theirs)


def test_int8_holds_about_twice_the_tokens_in_the_same_memory():
    budget = 64 << 20
    bf16 = LLM(MODEL, dtype="bfloat16", progress=False, kv_cache_memory_bytes=budget).llm_engine
    int8 = LLM(MODEL, dtype="bfloat16", progress=False, kv_cache_memory_bytes=budget, kv_cache_dtype="int8").llm_engine
    cfg = bf16.model_config  # 30 layers, 3 KV heads, head_dim 64, block_size 16
    bf16_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 2
    int8_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * (cfg.head_dim * 1 + 4)
    assert (bf16_block, int8_block) == (368640, 195840)
    assert bf16.num_kv_blocks == budget // bf16_block == 182
    assert int8.num_kv_blocks == budget // int8_block == 342
    assert int8.kv_capacity_tokens / bf16.kv_capacity_tokens == pytest.approx(2 * 64 / 68, rel=0.01)  # ~1.88x
    assert int8.kv_cache_bytes == 342 * int8_block <= budget
