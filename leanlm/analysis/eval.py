"""Perplexity and KL divergence of a model on a text file, through the engine's batched prompt-logprob path.

Protocol (GPTQ / AWQ WikiText-2): read the whole file, tokenize once without BOS, cut into windows of
seq_len tokens (the remainder is dropped), and score each token given its prefix inside its window; the
first token of each window has no prefix and is not scored. ppl = exp(mean NLL over the scored tokens).
KL(base || model) per scored token is measured on the same windows, as llama.cpp's --kl-divergence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from leanlm.sampling_params import SamplingParams

_SCORE_ONLY = SamplingParams(max_tokens=1, prompt_logprobs=0)  # the actual token's logprob, no top-k


@dataclass(frozen=True)
class Window:
    """One scored sequence: token_ids[num_context:] are scored, each given every token before it."""

    token_ids: tuple[int, ...]
    num_context: int  # leading tokens that are context only; >= 1, since token 0 has no prefix

    def __post_init__(self) -> None:
        if not 1 <= self.num_context < len(self.token_ids):
            raise ValueError(
                f"a window of {len(self.token_ids)} tokens needs 1 <= num_context < its length, "
                f"got {self.num_context}; use longer windows"
            )

    @property
    def num_scored(self) -> int:
        return len(self.token_ids) - self.num_context


def read_text(path: str | Path) -> str:
    """The whole file, as GPTQ's "\\n\\n".join of WikiText's dataset lines gives back the raw file."""
    return Path(path).read_text(encoding="utf-8")


def make_windows(
    token_ids: Sequence[int], seq_len: int, stride: int | None = None, max_windows: int | None = None
) -> list[Window]:
    """Windows of seq_len tokens starting every `stride` tokens (default seq_len: non-overlapping); a tail
    shorter than seq_len is dropped. With stride < seq_len a window's first seq_len - stride tokens are the
    previous window's, so they are context only and every token after the first window is scored once."""
    stride = seq_len if stride is None else stride
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one context token and one scored token), got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None (all), got {max_windows}")
    windows = []
    for i, start in enumerate(range(0, len(token_ids) - seq_len + 1, stride)):
        if max_windows is not None and i >= max_windows:
            break
        num_context = 1 if i == 0 else max(1, seq_len - stride)
        windows.append(Window(tuple(token_ids[start : start + seq_len]), num_context))
    if not windows:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {seq_len}; lower --seq-len")
    return windows


@dataclass(frozen=True)
class PerplexityResult:
    num_windows: int
    seq_len: int
    num_scored: int  # tokens that contributed an NLL
    nll_sum: float  # sum of -log p(token | prefix) over the scored tokens, in nats

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def token_logprobs(llm, windows: Sequence[Window], use_tqdm: bool = True) -> list[list[float]]:
    """Per window, the logprob of each scored token (windows[i].num_scored values). All windows go to the
    engine in one generate call, so they batch."""
    outputs = llm.generate([list(w.token_ids) for w in windows], _SCORE_ONLY, use_tqdm=use_tqdm)
    scores = []
    for window, out in zip(windows, outputs, strict=True):
        entries = out.prompt_logprobs  # entry j scores token j; entry 0 is None
        ids = window.token_ids
        scores.append([entries[j][ids[j]] for j in range(window.num_context, len(ids))])
    return scores


def perplexity(llm, windows: Sequence[Window], use_tqdm: bool = True) -> PerplexityResult:
    scores = token_logprobs(llm, windows, use_tqdm)
    # math.fsum: 290k terms summed in float64 without drift.
    nll_sum = -math.fsum(lp for window_scores in scores for lp in window_scores)
    return PerplexityResult(
        num_windows=len(windows),
        seq_len=len(windows[0].token_ids),
        num_scored=sum(w.num_scored for w in windows),
        nll_sum=nll_sum,
    )


@dataclass(frozen=True)
class KLResult:
    """KL(base || model) over the scored tokens, and what each model makes of the text."""

    num_scored: int
    kl_per_token: torch.Tensor  # [N] float64, nats
    top1_agreement: float  # fraction of positions where both argmaxes are the same token
    base: PerplexityResult
    model: PerplexityResult

    @property
    def mean_kl(self) -> float:
        return float(self.kl_per_token.mean())

    @property
    def max_kl(self) -> float:
        return float(self.kl_per_token.max())

    def kl_quantile(self, q: float) -> float:
        return float(torch.quantile(self.kl_per_token, q))


_KL_ROWS = 256  # positions reduced at a time in kl_divergence


def kl_divergence(
    base_llm, llm, windows: Sequence[Window], windows_per_batch: int = 4, use_tqdm: bool = True
) -> KLResult:
    """Score the windows with both models (LLM.score: full distributions, windows_per_batch at a time to
    bound memory at 2 * windows_per_batch * seq_len * V floats) and reduce per token."""
    if windows_per_batch < 1:
        raise ValueError(f"windows_per_batch must be >= 1, got {windows_per_batch}")
    kls, agree, base_nll, model_nll = [], 0, 0.0, 0.0
    batches = [windows[i : i + windows_per_batch] for i in range(0, len(windows), windows_per_batch)]
    for batch in tqdm(batches, desc="KL divergence", unit="batch", disable=not use_tqdm, leave=False):
        token_lists = [list(w.token_ids) for w in batch]
        base_lps = base_llm.score(token_lists, use_tqdm=False)
        model_lps = llm.score(token_lists, use_tqdm=False)
        for window, base_lp, model_lp in zip(batch, base_lps, model_lps, strict=True):
            targets = torch.tensor(window.token_ids[window.num_context :]).unsqueeze(1)  # [n, 1]
            # row i scores token i + 1; float64 in chunks of rows (a [2048, 152k] float64 block is 2.5 GB)
            for start in range(0, len(targets), _KL_ROWS):
                rows = slice(window.num_context - 1 + start, window.num_context - 1 + start + _KL_ROWS)
                p, q = base_lp[rows].double(), model_lp[rows].double()  # [n, V] logprobs
                tgt = targets[start : start + _KL_ROWS]
                # sum_v p_v (log p_v - log q_v); exp(-inf) * (-inf - x) would be nan: zero-probability terms are 0.
                kls.append(torch.where(p > -math.inf, p.exp() * (p - q), 0.0).sum(dim=-1))
                agree += int((p.argmax(dim=-1) == q.argmax(dim=-1)).sum())
                base_nll -= float(p.gather(1, tgt).sum())
                model_nll -= float(q.gather(1, tgt).sum())
    kl = torch.cat(kls)
    seq_len = len(windows[0].token_ids)

    def result(nll: float) -> PerplexityResult:
        return PerplexityResult(num_windows=len(windows), seq_len=seq_len, num_scored=kl.numel(), nll_sum=nll)

    return KLResult(kl.numel(), kl, agree / kl.numel(), result(base_nll), result(model_nll))
