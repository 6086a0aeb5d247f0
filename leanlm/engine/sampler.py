"""Batched sampler: logits [B, V] + SamplingMetadata -> one token per row, plus logprobs of the raw model
distribution. Min-tokens mask, OpenAI logit bias, penalties (CTRL repetition, OpenAI presence/frequency), a grammar's
token mask (structured output), greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2019), min-p; random rows
sample by inverse CDF (one uniform per row against the running mass), which draws exactly from p and lets seeded rows
use their own generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.engine.sampling_metadata import SamplingMetadata
from leanlm.kernels import cpu_rows


@dataclass
class LogprobsTensors:
    """Logprobs of N scored tokens. Column 0 is the scored (sampled or actual) token, then the top-K."""

    token_ids: torch.Tensor  # [N, K+1] long
    logprobs: torch.Tensor  # [N, K+1] float32
    ranks: torch.Tensor  # [N] long: 1 + number of tokens strictly more likely than the scored one


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Stateless; callable as `sampler(logits, metadata)`."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, metadata)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.max_num_logprobs is None and is_plain_greedy(metadata):
            # argmax is the same on the raw logits (bf16 -> float32 is exact and monotone, ties go to the
            # first index either way): skip the [B, V] float32 copy, 2-10 ms of a 64-row step. Grammar rows alone
            # take the argmax of their masked logits.
            sampled = cpu_rows.argmax(logits)
            if metadata.grammar_rows is not None:
                sampled[metadata.grammar_rows] = masked_argmax(logits[metadata.grammar_rows], metadata.grammar_banned)
            return SamplerOutput(sampled_token_ids=sampled, logprobs=None)
        if metadata.max_num_logprobs is None and is_sparse_greedy(metadata):
            # greedy under a few edited ids (logit_bias, min-tokens): the same tokens without the [B, V] copy
            return SamplerOutput(sampled_token_ids=sparse_greedy(logits, metadata), logprobs=None)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            # vLLM's default: logprobs of the raw model distribution, before any processing.
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
        # A float32 copy: the steps below edit in place, and low precision would distort the softmax.
        sampled = self._sample_processed(process_logits(logits, metadata), metadata)
        if metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_processed(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        greedy = None if metadata.all_random else logits.argmax(dim=-1)  # before temperature edits logits
        sampled = inverse_cdf_sample(target_probs(logits, metadata), metadata.generators)
        return sampled if greedy is None else torch.where(metadata.is_greedy, greedy, sampled)


def is_plain_greedy(metadata: SamplingMetadata) -> bool:
    """Every row greedy, and nothing edits the logits before the argmax."""
    return (
        metadata.all_greedy
        and metadata.no_penalties
        and metadata.min_tokens_rows is None
        and metadata.logit_bias_rows is None
    )


def is_sparse_greedy(metadata: SamplingMetadata) -> bool:
    """Every row greedy, and only logit_bias and min-tokens edit the logits: a few ids per row (no grammar's mask)."""
    return metadata.all_greedy and metadata.no_penalties and metadata.grammar_rows is None


def masked_argmax(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """argmax [M] of logits [M, V] over the tokens not banned [M, V] bool (float32 copy of these rows only)."""
    return logits.float().masked_fill_(banned, float("-inf")).argmax(dim=-1)


def sparse_greedy(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """argmax(process_logits(logits)) [B] for all-greedy rows without penalties, without the float32 [B, V] copy.

    Only the C columns that min-tokens or logit_bias touch differ from the raw logits: those are copied ([B, C]
    float32) and edited exactly as process_logits edits them. The raw argmax of a row, when it is not one of those
    columns, is the best of the untouched ones; it then competes with the best edited column under argmax's own
    rules (larger wins, NaN counts as largest, ties go to the lower index). A row whose raw argmax is an edited
    column (a banned EOS the model wants, say) takes the full path, alone."""
    edits = _edited_columns(logits, metadata)
    if edits is None:
        return cpu_rows.argmax(logits)
    cols, edited = edits  # [C] ascending token ids, [B, C] float32
    raw_best = cpu_rows.argmax(logits)  # [B]
    rows = torch.arange(logits.shape[0], device=logits.device)
    raw_value = logits[rows, raw_best].float()  # [B]
    col_pos = edited.argmax(dim=-1)  # [B]: first largest (NaN largest), columns ascending
    col_best, col_value = cols[col_pos], edited[rows, col_pos]
    tie_or_both_nan = (col_value == raw_value) | (col_value.isnan() & raw_value.isnan())
    take_col = (
        (col_value > raw_value) | (col_value.isnan() & ~raw_value.isnan()) | (tie_or_both_nan & (col_best < raw_best))
    )
    best = torch.where(take_col, col_best, raw_best)
    for row in torch.isin(raw_best, cols).nonzero().flatten().tolist():  # the raw best was edited: whole row
        full = logits[row].to(torch.float32, copy=True)  # [V]: float() would alias float32 logits
        full[cols] = edited[row]
        best[row] = full.argmax()
    return best


def _edited_columns(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(columns [C], their float32 logits [B, C] with min-tokens and logit_bias applied), or None if none."""
    ids = [t for t in (metadata.min_tokens_token_ids, metadata.logit_bias_token_ids) if t is not None]
    if not ids:
        return None
    cols = torch.unique(torch.cat(ids))  # [C], sorted ascending
    edited = logits[:, cols].float()  # [B, C]
    if metadata.min_tokens_rows is not None:
        edited[metadata.min_tokens_rows, torch.searchsorted(cols, metadata.min_tokens_token_ids)] = float("-inf")
    if metadata.logit_bias_rows is not None:
        at = torch.searchsorted(cols, metadata.logit_bias_token_ids)
        edited.index_put_((metadata.logit_bias_rows, at), metadata.logit_bias_values, accumulate=True)
    return cols, edited


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Raw logits -> the logits the rows sample from: a float32 copy with min-tokens, logit bias, penalties and the
    grammar's mask (last: -inf stays -inf whatever the penalties do, and nothing after it can revive a token)."""
    logits = logits.to(dtype=torch.float32, copy=True)  # [B, V]
    apply_min_tokens(logits, metadata)
    apply_logit_bias(logits, metadata)
    logits = apply_penalties(logits, metadata)
    apply_grammar(logits, metadata)
    return logits


def apply_grammar(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: -inf where a constrained row's grammar forbids the token."""
    if metadata.grammar_rows is not None:
        rows = metadata.grammar_rows
        logits[rows] = logits[rows].masked_fill_(metadata.grammar_banned, float("-inf"))


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Processed logits -> each random row's sampling distribution [B, V] (temperature, top-k, top-p, min-p),
    unnormalized where min-p dropped mass. Edits `logits` in place. Greedy rows are meaningless here."""
    logits.div_(metadata.temperature.unsqueeze(1))
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    if metadata.min_p is not None:
        probs = apply_min_p(probs, metadata.min_p)
    return probs


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: rows still short of min_tokens cannot end, so their EOS / stop ids get -inf."""
    if metadata.min_tokens_rows is not None:
        logits[metadata.min_tokens_rows, metadata.min_tokens_token_ids] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place: OpenAI logit_bias, added to the raw logits (a bias of -100 effectively bans a token)."""
    if metadata.logit_bias_rows is not None:
        logits.index_put_(
            (metadata.logit_bias_rows, metadata.logit_bias_token_ids), metadata.logit_bias_values, accumulate=True
        )


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens only), as vLLM."""
    if metadata.no_penalties:
        return logits
    counts = metadata.output_token_counts  # [B, V] int32
    in_output = counts > 0  # [B, V]
    seen = in_output if metadata.prompt_token_mask is None else in_output | metadata.prompt_token_mask
    rep = metadata.repetition_penalties.unsqueeze(1)  # [B, 1]
    # CTRL: shrink a seen token's logit toward "less likely" whatever its sign.
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= metadata.frequency_penalties.unsqueeze(1) * counts
    logits -= metadata.presence_penalties.unsqueeze(1) * in_output
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> torch.Tensor:
    """Mask to -inf the tokens outside each row's top-k and top-p set. One sort, only when either is used;
    when every row keeps at most max_top_k tokens, a top-k of that size replaces the full sort.

    Top-p keeps the smallest most-likely set whose mass is >= top_p (always at least the top token); its
    mass is measured after top-k, as in vLLM. Ties at the k-th value are broken by sort order: exactly k stay.
    """
    if top_k is None and top_p is None:
        return logits
    if max_top_k is None:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V]
    else:
        sorted_logits, sorted_idx = logits.topk(max_top_k, dim=-1)  # [B, K], sorted descending
    if top_k is not None:
        positions = torch.arange(sorted_logits.shape[-1], device=logits.device)  # [V] or [K]
        sorted_logits.masked_fill_(positions.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # renormalized over the top-k survivors
        # Mass of the strictly more likely tokens: exactly 0 for the top token, so it is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p.unsqueeze(1)
        # top_p == 1 keeps everything; without this, a cumsum rounding past 1.0 could drop the tail.
        drop &= (top_p < 1.0).unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    # Tokens the top-k path never looked at stay -inf; the full sort path overwrites every entry.
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's max. Unnormalized is fine: the
    inverse-CDF draw samples proportionally to whatever mass is left."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from unnormalized probs [B, V] (>= 0): the first token whose running mass exceeds
    u * total, u ~ U[0, 1). Token i wins with probability p_i / sum(p); zero-probability tokens never win.
    Seeded rows draw their own u, so their tokens do not depend on the rest of the batch. One uniform per
    row and a cumulative sum: ~3 ms for 64 x 49152, where an exponential race (argmax p / q, q ~ Exp(1))
    drew 3M exponentials in ~60 ms."""
    cdf = probs.cumsum(dim=-1)  # [B, V] float32
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=cdf.device)  # [B, 1]
    for row, generator in generators.items():
        u[row] = torch.rand(1, generator=generator, dtype=cdf.dtype)
    sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)  # [B]
    return sampled.clamp_max_(probs.shape[-1] - 1)  # u * total rounding up to total: the last positive token


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """From normalized logprobs [N, V]: the scored tokens' logprobs and ranks, and the top num_logprobs."""
    token_ids = token_ids.to(dtype=torch.long).unsqueeze(1)  # [N, 1]
    token_logprobs = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # [N]
    num_logprobs = min(num_logprobs, logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, K]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Score token_ids [N] under logits [N, V] (any float dtype; computed in float32). For prompt
    logprobs the caller passes the logits at positions i and the prompt tokens at i + 1."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_logprobs)


def logprobs_to_dicts(lp: LogprobsTensors, num_logprobs_per_row: list[int]) -> list[dict[int, float]]:
    """One {token id: logprob} per row: the scored token first (always present), then the row's top-k."""
    token_ids = lp.token_ids.tolist()  # one device-to-host copy per tensor
    logprobs = lp.logprobs.tolist()
    dicts = []
    for ids, values, k in zip(token_ids, logprobs, num_logprobs_per_row, strict=True):
        dicts.append(dict(zip(ids[: k + 1], values[: k + 1])))
    return dicts
