"""The public API on the real bundled model (SmolLM2-135M-Instruct), checked against HF transformers."""

from __future__ import annotations

import pytest
import torch

from leanlm import LLM, BeamSearchParams, SamplingParams
from leanlm.loading import ModelLoadError

TEXTS = [
    "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building, and the tallest "
    "structure in Paris. Its base is square, measuring 125 metres (410 ft) on each side.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n    return quicksort([x for x",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make sugar.",
    "<|im_start|>user\nWhat is 12 times 12?<|im_end|>\n<|im_start|>assistant\n12 times 12 is 144.<|im_end|>",
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "List three primary colors.",
    "What is 7 plus 5?",
]
COMPLETIONS = [
    "Once upon a time, in a small village,",
    "The main causes of the French Revolution were",
    "import numpy as np\n\ndef mean(values):",
    "Water boils at",
]

pytestmark = pytest.mark.real_model  # the bundled model throughout


@pytest.fixture(scope="module")
def llm():
    # float weights dequantized at load: the numbers of the GGUF codes path (the same dequantization, once), at
    # float32 GEMV speed rather than a dequantization per product (tests/formats/gguf/test_codes.py runs codes)
    return LLM(dtype="float32", progress=False, max_num_seqs=16, dequantize_gguf=True)


def _prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    chats = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    return chats + [tok.encode(t) for t in COMPLETIONS]


def test_prompt_logprobs_match_hf(llm, hf_smollm):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    worst = 0.0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf_smollm(torch.tensor([ids])).logits[0].double(), -1)  # [P, V]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        ours = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))], dtype=torch.float64)
        theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        worst = max(worst, (ours - theirs).abs().max().item())
    assert worst <= 1e-3, worst


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain argmax over HF's own KV cache; EOS is just a token (like ignore_eos), never suppressed."""
    generated = []
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            generated.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[generated[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def test_greedy_continuations_match_hf_alone_and_batched(llm, hf_smollm):
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for ids, together in zip(prompts, batched):
        alone = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
        reference = _hf_greedy(hf_smollm, ids, 64)
        assert alone == reference
        assert together == reference
    engine = llm.llm_engine
    assert engine.stats().num_free_kv_blocks == engine.num_kv_blocks


def test_chat_answers_sensibly(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=32, temperature=0.0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, not by length
    assert "<|im_end|>" not in out.outputs[0].text


def test_beam_search_beats_greedy_and_matches_hf(llm, hf_smollm):
    tok = llm.get_tokenizer()
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}]), add_special_tokens=False)
    prompts = [tok.encode("The capital of France is"), chat]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=12), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(out.sequences) == 4 and "Paris" in out.sequences[0].text
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        best = out.sequences[0]
        greedy = llm.generate(
            [prompt],
            SamplingParams(max_tokens=len(best.token_ids), temperature=0.0, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )[0].outputs[0]
        assert best.cumulative_logprob >= greedy.cumulative_logprob - 1e-4
    assert outs[1].sequences[0].finish_reason == "stop" and "<|im_end|>" not in outs[1].sequences[0].text
    # HF transformers' own beam search finds the same hypotheses in the same order.
    eos = list(llm.llm_engine.eos_token_ids)
    with torch.no_grad():
        ref = hf_smollm.generate(
            torch.tensor([prompts[0]]),
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    assert [s.token_ids for s in outs[0].sequences] == [row[len(prompts[0]) :] for row in ref.tolist()]
    engine = llm.llm_engine
    assert engine.stats().num_free_kv_blocks == engine.num_kv_blocks


def test_sampling_with_seed_is_reproducible_and_detokenizes_cleanly(llm):
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, top_k=50, seed=42, logprobs=2)
    prompts = ["Tell me a story about a dragon", "Le chat est", "日本の首都は"]
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts[::-1], params, use_tqdm=False)[::-1]
    tok = llm.get_tokenizer()
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # an output cut mid-character withholds the incomplete character instead of showing U+FFFD
        assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids).rstrip("\ufffd")
        assert "\ufffd" not in a.outputs[0].text
        assert all(t in lp for t, lp in zip(a.outputs[0].token_ids, a.outputs[0].logprobs))


def test_bad_input_is_rejected_and_disturbs_nothing(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", ""], params, use_tqdm=False)
    with pytest.raises(ValueError, match="context holds"):
        llm.generate(["fine prompt", [5] * llm.llm_engine.max_model_len], params, use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [params] * 3, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued by the failed calls
    out = llm.generate(["fine prompt"], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert out.prompt == "fine prompt" and out.prompt_token_ids == llm.get_tokenizer().encode("fine prompt")


def test_unknown_model_and_option():
    with pytest.raises(ModelLoadError, match="bundled models"):
        LLM("no-such-model", progress=False)
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM(block_sise=16)


def test_kv_pool_sized_from_memory_budget():
    llm = LLM(dtype="bfloat16", progress=False, kv_cache_memory_bytes=64 << 20)
    cfg = llm.model_config
    per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert llm.llm_engine.num_kv_blocks == (64 << 20) // per_block
    assert llm.llm_engine.kv_cache_bytes <= 64 << 20


@pytest.mark.slow
def test_qwen2_real_model_matches_hf():
    """The qwen2 path (q/k/v bias, no rotary permutation, 151k vocab) on the real Qwen2.5-Coder-0.5B GGUF."""
    transformers = pytest.importorskip("transformers")
    from leanlm.loading import resolve_model

    path = resolve_model("qwen2.5-coder-0.5b-instruct")  # `leanlm models pull qwen2.5-coder-0.5b-instruct`
    llm = LLM("qwen2.5-coder-0.5b-instruct", dtype="float32", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = llm.get_tokenizer().encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    out = llm.generate(
        [ids], SamplingParams(max_tokens=16, prompt_logprobs=0, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    ours = torch.tensor([out.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))], dtype=torch.float64)
    assert (ours - ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).abs().max() <= 1e-3
    assert out.outputs[0].token_ids == _hf_greedy(hf.eval(), ids, 16)


NEAR_TIE = 0.5  # nats between float32's top two tokens: below this, a half-precision flip is rounding, not a bug


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_track_float32(llm, dtype):
    """bf16/fp16 against float32 by distribution, not by text: the chat answer's first token is a near tie in
    float32 ("The" -1.88 vs "L" -1.97), so which one half precision picks depends on how the CPU rounds."""
    half = LLM(dtype=dtype, progress=False)
    assert half.dtype == getattr(torch, dtype)
    tok = llm.get_tokenizer()
    chat = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        add_special_tokens=False,
    )
    answer = llm.generate([chat], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"  # float32: the reference answer
    sequence = chat + answer.token_ids
    ref = llm.score([sequence], use_tqdm=False)[0][len(chat) - 1 :]  # [n, V] float32 log-probs of the answer
    got = half.score([sequence], use_tqdm=False)[0][len(chat) - 1 :].to(ref.dtype)
    kl = (ref.exp() * (ref - got)).sum(-1)  # KL(float32 || half) per position
    assert kl.mean() < 0.01 and kl.max() < 0.05, (kl.mean(), kl.max())  # measured: bf16 5e-4 / 2e-3, fp16 1e-5
    top2 = ref.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > NEAR_TIE
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    # Text only where float32's margin is wide (checked here first): " Paris" leads by ~2.5 nats.
    prompt = tok.encode("The capital of France is")
    paris = tok.encode(" Paris")
    first = llm.score([prompt + paris], use_tqdm=False)[0][len(prompt) - 1].topk(2)  # the row after the prompt
    assert first.values[0] - first.values[1] > 2 * NEAR_TIE and first.indices[0] == paris[0]
    out = half.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [int(first.indices[0])]
