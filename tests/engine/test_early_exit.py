"""CALM's early exit at decode: identical to plain decoding when no token is confident enough, a token-for-token
match with a reference CALM decoder (dense K/V lists, float64) when some exit and some do not, so later tokens
read the propagated K/V of the skipped layers; the cache holds exactly the propagated states; a batch exits only
when all of its tokens may; bad settings are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from leanlm.config import EarlyExitConfig, EngineConfig
from leanlm.engine.early_exit import EarlyExit
from leanlm.engine.engine import LLMEngine
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.exit_head import softmax_max
from leanlm.model.forward import residual_stream
from leanlm.model.layers import apply_rotary
from leanlm.model.llama import build_model
from leanlm.model.paged_kv import PagedKVCache
from leanlm.sampling_params import SamplingParams
from leanlm.train.exits import ExitHeadsConfig, attach_exits
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict

NUM_LAYERS = 4
PROMPTS = [[5, 9, 14, 3, 22], [7, 7, 30, 2, 11, 19, 4, 8], [40, 1, 6]]


def _model(tokenizer, adapter_rank=0, seed=0):
    """A 4-layer tiny llama (float64) with a trained-looking exit after 2 layers: its norm and, with a rank, an
    adapter moved away from the identity."""
    config = dataclasses.replace(tiny_config(tokenizer.vocab_size), num_hidden_layers=NUM_LAYERS)
    model = build_model(config, tiny_state_dict(config, seed), torch.float64)
    attach_exits(model, ExitHeadsConfig(layers=(2,), adapter_rank=adapter_rank))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.model.exits.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.requires_grad_(False)


def _generate(model, tokenizer, prompts, max_tokens=12, logprobs=False, **options):
    engine = LLMEngine(
        model, tokenizer, EngineConfig.from_options(block_size=4, num_kv_blocks=64, **options), "cpu", torch.float64
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0 if logprobs else None)
    ids = [engine.add_request(p, params) for p in prompts]
    final = run_to_completion(engine)
    outputs = [final[i].outputs[0] for i in ids]
    if logprobs:  # each sampled token's log-probability
        return [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in outputs], engine.stats().early_exit
    return [o.token_ids for o in outputs], engine.stats().early_exit


@torch.no_grad()
def calm_reference(model, prompt: list[int], num_tokens: int, exit_at: int, threshold: float):
    """CALM by hand: K/V kept per layer in lists, every decode token's confidence (softmax) read at the exit
    after `exit_at` layers; a confident token takes the exit's argmax and its K/V in the layers after come from
    the hidden state where it left. Returns the tokens, their log-probabilities and how many exited."""
    layers = model.model.layers
    keys, values = [[] for _ in layers], [[] for _ in layers]

    def attend(layer_idx, h, rope):  # h [T, hidden] normed; appends its K/V and attends causally
        attn = layers[layer_idx].self_attn
        T = h.shape[0]
        q = apply_rotary(attn.q_proj(h).view(T, attn.num_heads, attn.head_dim), *rope)
        keys[layer_idx].append(apply_rotary(attn.k_proj(h).view(T, attn.num_kv_heads, attn.head_dim), *rope))
        values[layer_idx].append(attn.v_proj(h).view(T, attn.num_kv_heads, attn.head_dim))
        k, v = torch.cat(keys[layer_idx]), torch.cat(values[layer_idx])  # [S, Hkv, D]
        groups = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        mask = torch.ones(T, k.shape[0], dtype=torch.bool).tril(k.shape[0] - T)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=attn.scale
        )
        return attn.o_proj(out.transpose(0, 1).reshape(T, -1))

    def run(x, rope, first, last):
        for i in range(first, last):
            x = x + attend(i, layers[i].input_layernorm(x), rope)
            x = x + layers[i].mlp(layers[i].post_attention_layernorm(x))
        return x

    ids, exited, logprobs = list(prompt), 0, []
    positions = torch.arange(len(ids))
    x = run(model.model.embed_tokens(torch.tensor(ids)), model.rotary_emb(positions, torch.float64), 0, len(layers))
    scores = model.compute_logits(model.model.norm(x[-1:]))
    ids.append(int(scores.argmax()))
    logprobs.append(float(scores.log_softmax(-1).max()))
    exit_head = model.model.exits[str(exit_at)]
    while len(ids) < len(prompt) + num_tokens:
        rope = model.rotary_emb(torch.tensor([len(ids) - 1]), torch.float64)
        x = run(model.model.embed_tokens(torch.tensor(ids[-1:])), rope, 0, exit_at)
        scores = model.lm_head(exit_head(x))
        if float(softmax_max(scores)[0]) >= threshold:
            exited += 1
            for i in range(exit_at, len(layers)):
                attn = layers[i].self_attn
                h = layers[i].input_layernorm(x)
                keys[i].append(apply_rotary(attn.k_proj(h).view(1, attn.num_kv_heads, attn.head_dim), *rope))
                values[i].append(attn.v_proj(h).view(1, attn.num_kv_heads, attn.head_dim))
        else:
            scores = model.compute_logits(model.model.norm(run(x, rope, exit_at, len(layers))))
        ids.append(int(scores.argmax()))
        logprobs.append(float(scores.log_softmax(-1).max()))
    return ids[len(prompt) :], logprobs, exited


def test_an_unreachable_threshold_decodes_exactly_as_without_exits(tokenizer):
    model = _model(tokenizer)
    plain, none = _generate(model, tokenizer, PROMPTS)
    assert none is None
    for measure in ("softmax", "gap", "saturation"):
        calm, stats = _generate(model, tokenizer, PROMPTS, early_exit="2:1.01", early_exit_measure=measure)
        assert calm == plain, measure
        assert stats.exit_rate == 0 and stats.mean_layers == NUM_LAYERS and stats.num_tokens == 3 * 11


@pytest.mark.parametrize("adapter_rank", [0, 8])
def test_calm_matches_a_reference_decoder_with_state_propagation(tokenizer, adapter_rank):
    model = _model(tokenizer, adapter_rank)
    # a threshold near the middle of the exit's confidences, so tokens both leave and stay
    threshold = _middle_confidence(model, tokenizer)
    got, stats = _generate(model, tokenizer, [PROMPTS[0]], early_exit=f"2:{threshold}")
    want, want_logprobs, exited = calm_reference(model, PROMPTS[0], 12, 2, threshold)
    assert got == [want]
    # the log-probabilities too: a full step after an exit reads the propagated K/V, and they shape its numbers
    got_logprobs, _ = _generate(model, tokenizer, [PROMPTS[0]], early_exit=f"2:{threshold}", logprobs=True)
    assert got_logprobs[0] == pytest.approx(want_logprobs, abs=2e-6)  # the sampler works in float32
    assert 0 < exited < 11 and stats.exited == {2: exited}
    assert stats.mean_layers == pytest.approx((exited * 2 + (11 - exited) * NUM_LAYERS) / 11)


def _middle_confidence(model, tokenizer) -> float:
    """The median softmax confidence at the exit over a plain greedy run of PROMPTS[0]'s continuation."""
    tokens, _ = _generate(model, tokenizer, [PROMPTS[0]])
    ids = torch.tensor([PROMPTS[0] + tokens[0]])
    with torch.no_grad():
        stream = list(residual_stream(model, ids, 2))[-1][0, len(PROMPTS[0]) :]  # [11 + 1, hidden]
        scores = model.lm_head(model.model.exits["2"](stream))
    return float(softmax_max(scores).median())


def test_the_skipped_layers_hold_the_propagated_state(tokenizer):
    model = _model(tokenizer, adapter_rank=8)
    prompt, token = PROMPTS[1], 17
    cache = PagedKVCache.allocate(NUM_LAYERS, 8, 2, 4, 16, torch.float64, torch.device("cpu"))
    blocks = [0, 1, 2]
    with forward_context(build_forward_context([len(prompt)], [len(prompt)], [blocks], cache)):
        model(torch.tensor(prompt), torch.arange(len(prompt)))
    calm = EarlyExit(model, EarlyExitConfig(((2, 0.0),)))  # every token leaves after 2 layers
    ctx = build_forward_context([1], [len(prompt) + 1], [blocks], cache)
    with forward_context(ctx):
        hidden, logits = calm.forward(torch.tensor([token]), torch.tensor([len(prompt)]), ctx)
    assert logits is not None

    ids = torch.tensor([prompt + [token]])
    streams = list(residual_stream(model, ids))  # the full model's stream after 0..4 layers
    torch.testing.assert_close(logits, model.lm_head(model.model.exits["2"](streams[2][0, -1:])))
    rope = model.rotary_emb(torch.tensor([len(prompt)]), torch.float64)
    slot = len(prompt)  # blocks 0, 1, 2 in order: slot = position
    for i, layer in enumerate(model.model.layers):
        source = streams[i] if i < 2 else streams[2]  # layers 2 and 3 were skipped: they get the state at 2
        h = layer.input_layernorm(source[0, -1:])
        attn = layer.self_attn
        k = apply_rotary(attn.k_proj(h).view(1, 2, 16), *rope)[0]  # [Hkv, D]
        v = attn.v_proj(h).view(2, 16)
        kv = cache.layer(i)
        torch.testing.assert_close(kv.k_cache[slot // 4, :, slot % 4], k)
        torch.testing.assert_close(kv.v_cache[slot // 4, :, slot % 4], v)


def test_a_batch_leaves_only_when_every_token_is_confident(tokenizer, monkeypatch):
    model = _model(tokenizer)
    calls = []

    def confidence(self, logits, before, after):
        calls.append(logits.shape[0])
        return torch.tensor([1.0, 0.0] if len(calls) % 2 else [1.0, 1.0], dtype=torch.float64)

    monkeypatch.setattr(EarlyExit, "_confidence", confidence)
    _, stats = _generate(model, tokenizer, PROMPTS[:2], max_tokens=5, early_exit="2:0.5")
    # 4 decode steps of both requests: the 1st and 3rd had one unsure token and ran every layer
    assert calls == [2, 2, 2, 2] and stats.exited == {2: 4} and stats.num_tokens == 8


def test_bad_settings_are_refused(tokenizer):
    for bad in ("24", "a:0.5", "24:x", "24:0.5,16:0.5", "0:0.5"):
        with pytest.raises(ValueError):
            EngineConfig.from_options(early_exit=bad)
    with pytest.raises(ValueError, match="do not combine"):
        EngineConfig.from_options(early_exit="2:0.5", speculative="ngram")
    with pytest.raises(ValueError):
        EngineConfig.from_options(early_exit="2:0.5", early_exit_measure="entropy")
    with pytest.raises(ValueError, match="more layers"):
        _generate(_model(tokenizer), tokenizer, PROMPTS[:1], early_exit="4:0.5")


def test_on_the_real_model_native_spans_equal_the_pytorch_path(smollm):
    """SmolLM2 in bf16 with the untrained exit at 24 (its final norm): the native decode loop, split into spans,
    decodes as it does whole when nothing exits, and exactly as the PyTorch layers do when tokens exit and their
    K/V are propagated."""
    model = build_model(smollm.config, smollm.state_dict, torch.bfloat16, quantized=smollm.quantized)
    prompts = [smollm.tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):\n")]

    def run(native: bool, **options):
        model.allow_native_decode = native
        engine = LLMEngine(model, smollm.tokenizer, EngineConfig.from_options(**options), "cpu", torch.bfloat16)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        final = run_to_completion(engine)
        return [final[i].outputs[0].token_ids for i in ids], engine.stats().early_exit

    try:
        plain, _ = run(True)
        never, stats = run(True, early_exit="24:1.01")
        assert never == plain and stats.num_tokens > 0 and stats.exit_rate == 0
        native, stats = run(True, early_exit="24:0.3")
        torch_path, torch_stats = run(False, early_exit="24:0.3")
        assert native == torch_path and stats.exited == torch_stats.exited
        assert 0 < stats.exit_rate < 1  # both kinds of step happened
    finally:
        model.allow_native_decode = True
