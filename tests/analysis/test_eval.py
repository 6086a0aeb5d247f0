"""Perplexity and KL divergence: windows, our perplexity against HF transformers on the same windows, KL
of a model against itself and against its bfloat16 copy."""

from __future__ import annotations

import math

import pytest
import torch

from leanlm.analysis.eval import Window, kl_divergence, make_windows, perplexity, read_text
from leanlm.data import wikitext2_test_path


def test_windows_drop_the_tail_and_leave_token_zero_unscored():
    windows = make_windows(list(range(10)), seq_len=4)
    assert [w.token_ids for w in windows] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [w.num_context for w in windows] == [1, 1]
    assert sum(w.num_scored for w in windows) == 6
    assert len(make_windows(list(range(10)), seq_len=4, max_windows=1)) == 1


def test_strided_windows_score_every_token_after_the_first_once():
    windows = make_windows(list(range(12)), seq_len=6, stride=2)
    scored = [t for w in windows for t in w.token_ids[w.num_context :]]
    assert scored == list(range(1, 12))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seq_len=1), "seq_len"),
        (dict(seq_len=4, stride=5), "stride"),
        (dict(seq_len=64), "fewer than one window"),
    ],
)
def test_bad_windows_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_windows(list(range(10)), **kwargs)
    with pytest.raises(ValueError, match="num_context"):
        Window((1, 2), num_context=2)


@pytest.fixture(scope="module")
def wiki_windows(real_tokenizer):
    ids = real_tokenizer.encode(read_text(wikitext2_test_path())[:20_000], add_special_tokens=False)
    return make_windows(ids, seq_len=256, max_windows=3)


def hf_perplexity(hf_model, windows) -> float:
    """The reference: one plain HF forward per window, the same tokens scored."""
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            logits = hf_model(torch.tensor([w.token_ids])).logits[0].float()  # [T, V]
            lp = torch.log_softmax(logits, dim=-1)[w.num_context - 1 : -1]  # row i scores token i + 1
            targets = torch.tensor(w.token_ids[w.num_context :])
            nll -= float(lp.gather(1, targets.unsqueeze(1)).sum())
            count += len(targets)
    return math.exp(nll / count)


def test_perplexity_matches_hf_on_the_same_windows(smollm_f32, hf_smollm, wiki_windows):
    ours = perplexity(smollm_f32, wiki_windows, use_tqdm=False)
    assert ours.num_scored == 3 * 255
    reference = hf_perplexity(hf_smollm, wiki_windows)
    assert 5 < reference < 100  # real text, a real model
    assert ours.perplexity == pytest.approx(reference, rel=1e-3)


def test_kl_of_a_model_against_itself_is_zero(smollm_f32, wiki_windows):
    result = kl_divergence(smollm_f32, smollm_f32, wiki_windows[:2], windows_per_batch=1, use_tqdm=False)
    assert result.num_scored == 2 * 255
    assert result.max_kl == pytest.approx(0.0, abs=1e-9)
    assert result.top1_agreement == 1.0
    assert result.base.perplexity == result.model.perplexity
    # the KL path's perplexity is the generate path's
    assert result.base.perplexity == pytest.approx(
        perplexity(smollm_f32, wiki_windows[:2], use_tqdm=False).perplexity, rel=1e-6
    )


def test_kl_float32_against_bfloat16_is_small_but_not_zero(smollm_f32, wiki_windows):
    from leanlm.llm import LLM

    bf16 = LLM(dtype="bfloat16", device="cpu", progress=False)
    result = kl_divergence(smollm_f32, bf16, wiki_windows[:2], use_tqdm=False)
    assert 0 < result.mean_kl < 0.05
    assert result.kl_quantile(0.99) <= result.max_kl
    assert 0.9 < result.top1_agreement < 1.0 or result.top1_agreement == 1.0
    assert result.model.perplexity == pytest.approx(result.base.perplexity, rel=0.05)


def test_score_returns_full_distributions_that_agree_with_prompt_logprobs(smollm_f32):
    from leanlm.sampling_params import SamplingParams

    ids = list(range(100, 140))
    [full] = smollm_f32.score([ids], use_tqdm=False)
    assert full.shape == (39, smollm_f32.model_config.vocab_size) and full.dtype == torch.float32
    assert torch.allclose(full.exp().sum(dim=-1), torch.ones(39), atol=1e-4)
    [out] = smollm_f32.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert out.prompt_logprobs_full is None
    for j in range(1, 40):
        assert out.prompt_logprobs[j][ids[j]] == pytest.approx(float(full[j - 1, ids[j]]), abs=1e-5)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(full_prompt_logprobs=True)
