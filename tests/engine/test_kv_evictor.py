"""The engine under a KV budget: bounded blocks, nothing leaked, untouched under the budget, and greedy tokens equal
to a dense forward whose attention sees exactly the tokens each step had kept (tiny float64 model)."""

from __future__ import annotations

import random

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine.kv_evictor import KVEvictor
from leanlm.model.layers import apply_rotary
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_blocks_stay_bounded_while_generating_and_none_leak(make_tiny_engine, policy):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=64, kv_budget=12, kv_eviction=policy)
    request_id = engine.add_request(_prompt(30), SamplingParams(max_tokens=60, **GREEDY))
    peak_after_prefill = 0
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.scheduler.requests.get(request_id)
        if request is not None and request.num_output_tokens > 1:
            blocks = engine.kv_cache_manager.get_block_ids(request_id)
            peak_after_prefill = max(peak_after_prefill, len(blocks))
            assert request.num_kv_tokens <= 12 + 4 + 1 and request.num_evicted_tokens > 0
    # budget + one block of slack + the step's token: ceil(17 / 4) blocks, whatever the 90 tokens
    assert 0 < peak_after_prefill <= 5
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_a_budget_the_sequence_fits_changes_nothing(make_tiny_engine, policy):
    prompts = [_prompt(23, seed) for seed in range(2)]
    params = SamplingParams(max_tokens=9, **GREEDY)
    plain = make_tiny_engine(block_size=4, num_kv_blocks=64)
    plain_ids = [plain.add_request(p, params) for p in prompts]
    plain_out = run_to_completion(plain)
    for budget in (32, 31):  # 32 = prompt + max_tokens: untouched; 31: scored, never over budget + a block
        engine = make_tiny_engine(block_size=4, num_kv_blocks=64, kv_budget=budget, kv_eviction=policy)
        ids = [engine.add_request(p, params) for p in prompts]
        out = run_to_completion(engine)
        for a, b in zip(ids, plain_ids):
            assert out[a].outputs[0].token_ids == plain_out[b].outputs[0].token_ids
            assert out[a].outputs[0].cumulative_logprob == plain_out[b].outputs[0].cumulative_logprob


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_batched_budgeted_requests_equal_each_alone(make_tiny_engine, policy):
    prompts = [_prompt(n, seed) for seed, n in enumerate((9, 26))]
    params = SamplingParams(max_tokens=24, **GREEDY)
    options = dict(block_size=4, num_kv_blocks=96, kv_budget=10, kv_eviction=policy)
    batched = make_tiny_engine(**options)
    ids = [batched.add_request(p, params) for p in prompts]
    together = run_to_completion(batched)
    for request_id, prompt in zip(ids, prompts):
        alone = make_tiny_engine(**options)
        own = alone.add_request(prompt, params)
        assert run_to_completion(alone)[own].outputs[0].token_ids == together[request_id].outputs[0].token_ids


def test_preempted_budgeted_requests_recompute_and_free_everything(make_tiny_engine):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=14, kv_budget=8, kv_eviction="h2o", max_num_seqs=4)
    # short prompts all admitted, then each grows to its budget + a block: 4 x 4 blocks of 14
    ids = [engine.add_request(_prompt(6, seed), SamplingParams(max_tokens=16, **GREEDY)) for seed in range(4)]
    out = run_to_completion(engine)
    assert all(len(out[i].outputs[0].token_ids) == 16 for i in ids)
    assert engine.scheduler.stats().num_preemptions > 0, "the small pool must preempt"
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_parallel_samples_under_a_budget_compute_their_own_prompts(make_tiny_engine):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=64, kv_budget=8, kv_eviction="snapkv")
    request_id = engine.add_request(_prompt(20), SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7))
    out = run_to_completion(engine)[request_id]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 12 for c in out.outputs)
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_budget_refuses_what_shares_or_splits_kv():
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig.from_options(kv_budget=64, speculative="ngram")
    with pytest.raises(ValueError, match="one process"):
        EngineConfig.from_options(kv_budget=64, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="at least 2"):
        EngineConfig.from_options(kv_budget=1)


class _KeptPositions:
    """A naive mirror of what the cache holds: per (layer, KV head) the positions of its slots, in slot order, kept
    through every selection; and for each computed position, per (layer, KV head), the positions it attended."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.slots = [[[] for _ in range(num_kv_heads)] for _ in range(num_layers)]
        self.seen: dict[int, list[list[list[int]]]] = {}

    def append(self, layer: int, positions: range) -> None:
        for head, slots in enumerate(self.slots[layer]):
            for p in positions:
                self.seen.setdefault(p, [[None] * len(self.slots[0]) for _ in self.slots])
                self.seen[p][layer][head] = slots + [q for q in positions if q <= p]
            slots.extend(positions)

    def keep(self, layer: int, keep: torch.Tensor) -> None:
        for head, slots in enumerate(self.slots[layer]):
            self.slots[layer][head] = [slots[i] for i in keep[head].tolist()]


def _dense_masked_logits(model, token_ids: list[int], seen) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Logits [T, V] of a dense float64 forward where position t, in layer l and KV head h, attends exactly to
    seen[t][l][h]; and its attention weights, [layer][head] -> [T, T]."""
    ids = torch.tensor(token_ids)
    positions = torch.arange(len(token_ids))
    x = model.model.embed_tokens(ids)
    all_weights = []
    rope = model.rotary_emb(positions, x.dtype)
    for layer_idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rotary(attn._project(h, attn.q_proj, attn.q_norm, attn.num_heads), *rope)
        k = apply_rotary(attn._project(h, attn.k_proj, attn.k_norm, attn.num_kv_heads), *rope)
        v = attn._project(h, attn.v_proj, None, attn.num_kv_heads)
        group = attn.num_heads // attn.num_kv_heads
        out = torch.zeros_like(q)
        all_weights.append([])
        for head in range(attn.num_heads):
            kv_head = head // group
            mask = torch.full((len(token_ids), len(token_ids)), float("-inf"), dtype=x.dtype)
            for t in range(len(token_ids)):
                mask[t, seen[t][layer_idx][kv_head]] = 0
            weights = ((q[:, head] @ k[:, kv_head].T) * attn.scale + mask).softmax(-1)
            out[:, head] = weights @ v[:, kv_head]
            all_weights[-1].append(weights)
        x = x + attn.o_proj(out.reshape(len(token_ids), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.compute_logits(model.model.norm(x)), all_weights


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_greedy_tokens_equal_a_dense_forward_over_the_kept_tokens(make_tiny_engine, monkeypatch, policy):
    engine = make_tiny_engine(block_size=4, num_kv_blocks=64, kv_budget=10, kv_eviction=policy,
                              max_num_batched_tokens=8)  # fmt: skip
    config = engine.model_config
    mirror = _KeptPositions(config.num_hidden_layers, config.num_key_value_heads)
    prompt = _prompt(21)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    request = engine.scheduler.requests[request_id]
    observe, keep = KVEvictor.observe, KVEvictor._keep
    selections, h2o = [], []

    def spy_observe(self, layer_idx, q, kv):
        # steps before the first selection may go unwatched (SnapKV): they only appended
        done = len(mirror.slots[layer_idx][0]) + request.num_evicted_tokens
        computed = request.num_computed_tokens + self._watched[0].num_rows
        mirror.append(layer_idx, range(done, computed))
        return observe(self, layer_idx, q, kv)

    def spy_keep(self, scores, layer_idx, layer, rows, kept):
        if scores.attention is not None:  # H2O: the scores it selects by, to check against the dense weights
            slots = [list(h) for h in mirror.slots[layer_idx]]
            h2o.append(
                (layer_idx, slots, request.num_computed_tokens, scores.attention[layer_idx, :, : rows.shape[1]].clone())
            )
        chosen = keep(self, scores, layer_idx, layer, rows, kept)
        mirror.keep(layer_idx, chosen)
        selections.append(layer_idx)
        return chosen

    monkeypatch.setattr(KVEvictor, "observe", spy_observe)
    monkeypatch.setattr(KVEvictor, "_keep", spy_keep)
    tokens = run_to_completion(engine)[request_id].outputs[0].token_ids
    assert len(selections) >= 4 * config.num_hidden_layers, "the budget must have evicted, again and again"
    sequence = prompt + list(tokens)
    logits, weights = _dense_masked_logits(engine.model, sequence[:-1], mirror.seen)
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == list(tokens)
    group = config.num_attention_heads // config.num_key_value_heads
    for layer_idx, slots, num_queries, got in h2o:  # accumulated attention of every query so far, per slot
        for kv_head, positions in enumerate(slots):
            heads = weights[layer_idx][kv_head * group : (kv_head + 1) * group]
            want = sum(w[:num_queries, positions].sum(0) for w in heads)
            torch.testing.assert_close(got[kv_head].double(), want, rtol=1e-5, atol=1e-6)
    assert (policy == "h2o") == bool(h2o)
