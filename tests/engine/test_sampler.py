"""Sampler tests: exact supports for top-k/top-p/min-p, distributions against softmax, hand-computed
penalties, min_tokens, seeded reproducibility across batch compositions, and raw-distribution logprobs."""

from __future__ import annotations

import pytest
import torch

from leanlm.engine.request import Request
from leanlm.engine.sampler import (
    Sampler,
    apply_penalties,
    compute_logprobs,
    logprobs_to_dicts,
    process_logits,
    sparse_greedy,
)
from leanlm.engine.sampling_metadata import SamplingMetadata
from leanlm.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_request(
    params: SamplingParams,
    prompt: list[int] = (1, 2, 3),
    output: list[int] = (),
    device: str = "cpu",
    request_id: str = "r",
) -> Request:
    request = Request(request_id, list(prompt), params, device=device)
    if output:
        request.append_output_token_ids(list(output))
    return request


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...] = ()):
    metadata = SamplingMetadata.from_requests(requests, logits.shape[-1], logits.device, eos_token_ids)
    return Sampler()(logits, metadata)


def draw_counts(logits_row: torch.Tensor, params: SamplingParams, num_draws: int, with_plain_row=False):
    """Sample num_draws tokens for copies of one logits row; returns [V] counts. with_plain_row adds an
    unfiltered row to the batch, which forces top-k through the full-sort path."""
    logits = logits_row.unsqueeze(0).expand(num_draws + with_plain_row, -1).contiguous()
    requests = [make_request(params) for _ in range(num_draws)] + [make_request(SamplingParams())] * with_plain_row
    metadata = SamplingMetadata.from_requests(requests, logits.shape[-1], logits.device)
    assert (metadata.max_top_k is None) == (with_plain_row or params.top_k is None)
    tokens = Sampler()(logits, metadata).sampled_token_ids[:num_draws]
    return torch.bincount(tokens, minlength=logits.shape[-1])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


# Chi-square with 5 degrees of freedom (V=6): P(X > 25) is about 1.4e-4.
CHI2_5DOF_BOUND = 25.0
# V=8 probabilities in a shuffled order, so "the top tokens" are not simply the first ids.
PROBS_8 = torch.tensor([0.05, 0.25, 0.005, 0.4, 0.03, 0.15, 0.015, 0.1])
LOGITS_8 = PROBS_8.log()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = torch.randn(5, 50, device=device)
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(5)]
    metadata = SamplingMetadata.from_requests(requests, 50, device)
    assert metadata.all_greedy and not metadata.all_random
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.long
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_low_temperature_approaches_greedy():
    logits = torch.randn(64, 100)
    requests = [make_request(SamplingParams(temperature=1e-3)) for _ in range(64)]
    assert not SamplingMetadata.from_requests(requests, 100, "cpu").is_greedy.any()  # really sampled
    assert torch.equal(sample(logits, requests).sampled_token_ids, logits.argmax(-1))


def test_top_k_1_is_greedy():
    logits = torch.randn(64, 100)
    requests = [make_request(SamplingParams(temperature=1.5, top_k=1)) for _ in range(64)]
    assert torch.equal(sample(logits, requests).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {3, 1, 5}),
        (SamplingParams(top_p=0.75), {3, 1, 5}),  # masses before: 0, .40, .65 < .75; .80 >= .75 stops
        (SamplingParams(top_p=0.6), {3, 1}),
        (SamplingParams(top_p=0.01), {3}),  # always keep the top token
        (SamplingParams(min_p=0.2), {3, 1, 5, 7}),  # prob >= 0.2 * 0.4 = 0.08
        (SamplingParams(top_k=2, top_p=0.6), {3}),  # top-p mass is renormalized after top-k: .4/.65 >= .6
        (SamplingParams(top_k=3, min_p=0.5), {3, 1}),
        (SamplingParams(), set(range(8))),
    ],
)
@pytest.mark.parametrize("with_plain_row", [False, True])
def test_filters_sample_exactly_the_allowed_set(params, allowed, with_plain_row):
    counts = draw_counts(LOGITS_8, params, 4000, with_plain_row)
    assert set(counts.nonzero().flatten().tolist()) == allowed


def test_per_row_top_k_on_the_top_k_path():
    requests = [make_request(SamplingParams(top_k=2 + 2 * (i % 2))) for i in range(4000)]
    requests[0] = make_request(SamplingParams(temperature=0.0))  # greedy rows do not force the full sort
    logits = LOGITS_8.unsqueeze(0).expand(4000, -1).contiguous()
    metadata = SamplingMetadata.from_requests(requests, 8, "cpu")
    assert metadata.max_top_k == 4
    tokens = Sampler()(logits, metadata).sampled_token_ids
    assert tokens[0].item() == 3
    assert set(tokens[2::2].tolist()) == {3, 1}
    assert set(tokens[1::2].tolist()) == {3, 1, 5, 7}


def test_top_p_keeps_distribution_within_the_set():
    params = SamplingParams(top_p=0.75)
    counts = draw_counts(LOGITS_8, params, 20000)
    kept = torch.tensor([3, 1, 5])
    expected = PROBS_8[kept] / PROBS_8[kept].sum()
    # 2 degrees of freedom: P(X > 20) is about 4.5e-5.
    assert chi_square(counts[kept], expected) < 20.0


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_tempered_softmax(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    counts = draw_counts(logits, SamplingParams(temperature=temperature), 20000)
    assert chi_square(counts, torch.softmax(logits / temperature, -1)) < CHI2_5DOF_BOUND
    if temperature != 1.0:  # the test can tell temperatures apart
        assert chi_square(counts, torch.softmax(logits, -1)) > 10 * CHI2_5DOF_BOUND


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 1.0, 0.0], [2.0, -1.0, 0.5, -2.0, 1.0, 0.0]])
    penalized = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    requests = [
        make_request(penalized, prompt=[0, 3], output=[2, 2, 4]),
        make_request(SamplingParams(), prompt=[0, 3], output=[2, 2, 4]),  # no penalties: untouched
    ]
    metadata = SamplingMetadata.from_requests(requests, 6, "cpu")
    assert not metadata.no_penalties
    out = apply_penalties(logits.clone(), metadata)
    # 0: prompt only, 2 / 2.  1: unseen.  2: 0.5 / 2 - 0.5 * 2 - 0.25.  3: prompt, -2 * 2.
    # 4: 1 / 2 - 0.5 * 1 - 0.25.  5: unseen.
    expected = torch.tensor([1.0, -1.0, -1.0, -4.0, -0.25, 0.0])
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    metadata = SamplingMetadata.from_requests([make_request(params, prompt=[0, 1], output=[1])], 4, "cpu")
    assert metadata.prompt_token_mask is None  # only repetition penalty needs the prompt
    torch.testing.assert_close(apply_penalties(logits, metadata), torch.tensor([[0.0, -2.0, 0.0, 0.0]]))


def test_no_penalties_skips_the_count_tensors():
    metadata = SamplingMetadata.from_requests([make_request(SamplingParams(), output=[1, 2])], 10, "cpu")
    assert metadata.no_penalties and metadata.output_token_counts is None


def test_penalties_steer_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sample(logits, [make_request(params, prompt=[2])]).sampled_token_ids.item() == 0
    assert sample(logits, [make_request(params, prompt=[0])]).sampled_token_ids.item() == 1


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0, 3.0]] * 4)  # eos 3 > stop id 4 > 5
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    no_eos = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,), ignore_eos=True)
    requests = [
        make_request(params, output=[1]),  # short: EOS and stop id masked
        make_request(params, output=[1, 1]),  # reached min_tokens: free to stop
        make_request(no_eos, output=[1]),  # ignore_eos: only the stop id is masked
        make_request(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(4,), top_k=3), output=[]),
    ]
    out = sample(logits, requests, eos_token_ids=(3, 100)).sampled_token_ids  # 100 is out of vocab
    assert out[:3].tolist() == [5, 3, 3]
    assert out[3].item() in {5, 2, 1}


def test_min_tokens_masks_random_rows_over_many_draws():
    params = SamplingParams(min_tokens=1, stop_token_ids=(1,))
    logits = LOGITS_8.unsqueeze(0).expand(2000, -1).contiguous()
    tokens = sample(logits, [make_request(params) for _ in range(2000)], eos_token_ids=(3,)).sampled_token_ids
    assert not torch.isin(tokens, torch.tensor([1, 3])).any()


def _seeded_run(logits_row, seed, batch_logits, position, steps=5):
    """Tokens sampled for a seeded request at `position` of a batch whose other rows are unseeded."""
    target = make_request(SamplingParams(seed=seed))
    others = [make_request(SamplingParams(temperature=0.8, top_p=0.9)) for _ in range(batch_logits.shape[0])]
    tokens = []
    for _ in range(steps):
        requests = others[:position] + [target] + others[position:]
        logits = torch.cat([batch_logits[:position], logits_row[None], batch_logits[position:]])
        tokens.append(sample(logits, requests).sampled_token_ids[position].item())
        target.append_output_token_ids(tokens[-1])
    return tokens


def test_seeded_row_is_independent_of_the_batch():
    vocab_size = 1000
    logits_row = torch.randn(vocab_size) * 0.5  # flat enough that a chance match is unlikely
    alone = _seeded_run(logits_row, 1234, torch.empty(0, vocab_size), 0)
    in_batch = _seeded_run(logits_row, 1234, torch.randn(6, vocab_size), 4)
    torch.manual_seed(99)  # a different global RNG state must not matter either
    other_position = _seeded_run(logits_row, 1234, torch.randn(3, vocab_size), 1)
    assert alone == in_batch == other_position
    assert _seeded_run(logits_row, 4321, torch.empty(0, vocab_size), 0) != alone


def test_same_seed_rows_sample_the_same_tokens():
    logits_row = torch.randn(1000) * 0.5
    logits = torch.stack([logits_row, torch.randn(1000), logits_row])
    requests = [make_request(SamplingParams(seed=s)) for s in (7, None, 7)]
    for _ in range(5):
        tokens = sample(logits, requests).sampled_token_ids
        assert tokens[0] == tokens[2]


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(4, 20)
    requests = [
        make_request(SamplingParams(logprobs=3, temperature=0.7, top_k=5, repetition_penalty=1.3), output=[1]),
        make_request(SamplingParams(logprobs=0, temperature=0.0)),
        make_request(SamplingParams(logprobs=5, seed=3, presence_penalty=1.0), output=[2]),
        make_request(SamplingParams()),  # asks for none; its row is computed but not reported
    ]
    metadata = SamplingMetadata.from_requests(requests, 20, "cpu")
    assert metadata.max_num_logprobs == 5
    out = Sampler()(logits, metadata)
    lp = out.logprobs
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 6)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values)
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)
    assert lp.ranks[1].item() == 1  # the greedy row took the most likely token

    dicts = logprobs_to_dicts(lp, [3, 0, 5, 0])
    for row, k in enumerate([3, 0, 5, 0]):
        chosen = sampled[row].item()
        assert chosen in dicts[row]
        assert dicts[row][chosen] == pytest.approx(raw[row, chosen].item())
        assert set(top_ids[row, :k].tolist()) <= set(dicts[row])
        assert len(dicts[row]) in (k, k + 1)  # k + 1 unless the chosen token is in the top-k
    assert dicts[1] == {sampled[1].item(): pytest.approx(raw[1].max().item())}


def test_compute_logprobs_for_prompt_positions():
    logits = torch.randn(5, 30, dtype=torch.bfloat16)
    prompt = torch.tensor([4, 7, 7, 29, 0, 3])
    lp = compute_logprobs(logits, prompt[1:], num_logprobs=2)
    raw = torch.log_softmax(logits.float(), -1)
    assert lp.logprobs.dtype == torch.float32
    torch.testing.assert_close(lp.logprobs[:, 0], raw[torch.arange(5), prompt[1:]])
    assert torch.equal(lp.ranks, (raw > raw[torch.arange(5), prompt[1:]][:, None]).sum(-1) + 1)
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(2, -1).indices)
    assert compute_logprobs(logits, prompt[1:], num_logprobs=100).token_ids.shape == (5, 31)  # capped at V


def test_mixed_batch_in_one_call():
    vocab_size = 200
    logits = torch.randn(6, vocab_size)
    logits[3, 10] = 50.0  # the EOS would win greedy row 3 without min_tokens
    requests = [
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05)),
        make_request(SamplingParams(seed=11, logprobs=2)),
        make_request(SamplingParams(temperature=0.0, min_tokens=4), output=[5]),
        make_request(SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=2.0), [7], [7]),
        make_request(SamplingParams(seed=11, temperature=1.0)),
    ]
    logits[4, 7] = logits[4].abs().max() + 0.5  # greedy would repeat token 7 without the penalties
    logits[5] = logits[2]
    out = sample(logits, requests, eos_token_ids=(10,))
    tokens = out.sampled_token_ids.tolist()
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[3] == logits[3].topk(2).indices[1].item()
    penalized = logits[4].clone()
    penalized[7] = penalized[7] / 3.0 - 2.0  # seen in prompt and output once, positive logit
    assert tokens[4] != 7 and tokens[4] == penalized.argmax().item()
    assert tokens[2] == tokens[5]  # same seed, same logits, same token whatever the other rows do
    alone = sample(logits[2:3], [make_request(SamplingParams(seed=11, logprobs=2))]).sampled_token_ids
    assert alone.item() == tokens[2]
    assert out.logprobs.token_ids.shape == (6, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_batch_runs(dtype):
    batch_size, vocab_size = 64, 49152
    logits = torch.randn(batch_size, vocab_size, dtype=dtype)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        SamplingParams(temperature=0.7, min_p=0.05, logprobs=5),
        SamplingParams(seed=1, repetition_penalty=1.1, frequency_penalty=0.2),
    ]
    requests = [
        make_request(kinds[i % 4], prompt=list(range(i, i + 100)), output=[i, i + 1]) for i in range(batch_size)
    ]
    out = sample(logits, requests, eos_token_ids=(2,))
    assert out.sampled_token_ids.shape == (batch_size,)
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < vocab_size)).all()
    assert out.logprobs.token_ids.shape == (batch_size, 6)
    assert logits.dtype == dtype  # the caller's logits are not modified or converted in place


def test_sampler_does_not_modify_input_logits():
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=3, min_tokens=2, repetition_penalty=2.0)
    sample(logits, [make_request(params, output=[1]), make_request(params)], eos_token_ids=(0,))
    assert torch.equal(logits, before)


def test_logit_bias_moves_greedy_choice_and_bans_tokens_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(3, 1)
    requests = [
        make_request(SamplingParams(temperature=0, logit_bias={3: -100})),  # banned: next best is 2
        make_request(SamplingParams(temperature=0, logit_bias={0: 5.0})),  # 0 + 5 beats 3
        make_request(SamplingParams(temperature=0)),  # untouched row
    ]
    assert sample(logits, requests).sampled_token_ids.tolist() == [2, 0, 3]
    # Logprobs stay those of the raw model distribution (vLLM's default), bias or not.
    params = SamplingParams(temperature=1.0, seed=0, logit_bias={0: -100, 1: -100, 2: -100}, logprobs=1)
    out = sample(logits[:1], [make_request(params)])
    assert out.sampled_token_ids.tolist() == [3]
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())


@pytest.mark.parametrize("bias", [{-1: 1.0}, {5: 101.0}, {5: -100.5}])
def test_logit_bias_validation(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def _sparse_case(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[Request]]:
    """bf16-like logits with ties, -inf, NaN, and rows whose raw best is a biased or min-tokens id."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (12, 40), generator=gen).float()  # few distinct values: many ties
    logits[0, 5] = 9.0  # row 0: the raw best is banned below
    logits[1, :] = float("-inf")  # row 1: nothing is finite but the boosted id
    logits[1, 9] = -5.0
    logits[2, 7] = float("nan")  # row 2: a NaN beats everything, edited or not
    logits[3, 5] = float("nan")  # row 3: a NaN on a banned id (its bias keeps it NaN)
    logits[4, 0] = 9.0  # row 4: min-tokens masks EOS 0, the raw best
    logits[5, :] = 1.0  # row 5: all tied; a boost of 0 keeps the first index
    logits = logits.to(dtype)
    biases = [{5: -100}, {9: 0.5}, {7: 1.0}, {5: -100}, {}, {3: 0.0}] + [{5: -100, 11: 1.0 + i} for i in range(6)]
    requests = [
        make_request(SamplingParams(temperature=0, logit_bias=b, min_tokens=2 if i % 4 == 0 else 0), request_id=f"r{i}")
        for i, b in enumerate(biases)
    ]
    return logits, requests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_greedy_equals_the_full_path(dtype, seed):
    logits, requests = _sparse_case(dtype, seed)
    metadata = SamplingMetadata.from_requests(requests, logits.shape[-1], "cpu", eos_token_ids=(0,))
    assert metadata.min_tokens_rows is not None and metadata.logit_bias_rows is not None
    before = logits.clone()
    expected = process_logits(logits, metadata).argmax(dim=-1)
    assert torch.equal(sparse_greedy(logits, metadata), expected)
    assert torch.equal(Sampler()(logits, metadata).sampled_token_ids, expected)
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())
    assert expected[0].item() != 5 and expected[4].item() != 0 and expected[2].item() == 7 and expected[1].item() == 9
