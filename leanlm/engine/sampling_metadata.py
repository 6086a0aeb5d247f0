"""SamplingMetadata: one step's per-request SamplingParams turned into per-row tensors for the batched
sampler. Built once per step from the scheduled requests; features nobody uses stay None so the sampler
skips their work."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.engine.request import Request


@dataclass
class SamplingMetadata:
    """Per-row sampling settings, row i = requests[i]. Optional tensors are None when no row uses them."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows so dividing by it is always safe
    is_greedy: torch.Tensor  # [B] bool; these rows take the argmax of the (penalized) logits
    all_greedy: bool  # every row is greedy: skip random sampling
    all_random: bool  # no row is greedy: skip the argmax
    top_k: torch.Tensor | None  # [B] long in [1, V]; V where disabled; None when no random row uses top-k
    max_top_k: int | None  # max top_k when every random row has one < V: a top-k replaces the full sort
    top_p: torch.Tensor | None  # [B] float32 in (0, 1]; 1.0 where disabled; None when unused
    min_p: torch.Tensor | None  # [B] float32 in [0, 1]; 0.0 where disabled; None when unused
    no_penalties: bool  # no row uses any penalty: the four fields below are None
    presence_penalties: torch.Tensor | None  # [B] float32; 0.0 disables
    frequency_penalties: torch.Tensor | None  # [B] float32; 0.0 disables
    repetition_penalties: torch.Tensor | None  # [B] float32; 1.0 disables
    output_token_counts: torch.Tensor | None  # [B, V] int32: occurrences of each token in the output
    prompt_token_mask: torch.Tensor | None  # [B, V] bool: token appears in the prompt (repetition penalty)
    # min_tokens: (row, token id) pairs set to -inf: EOS and stop ids of rows still short of min_tokens.
    min_tokens_rows: torch.Tensor | None  # [M] long
    min_tokens_token_ids: torch.Tensor | None  # [M] long
    # logit_bias: (row, token id, bias) triples added to the logits; None when no row has a bias.
    logit_bias_rows: torch.Tensor | None  # [M] long
    logit_bias_token_ids: torch.Tensor | None  # [M] long
    logit_bias_values: torch.Tensor | None  # [M] float32
    generators: dict[int, torch.Generator]  # row -> generator, for seeded random rows only
    max_num_logprobs: int | None  # max over rows of SamplingParams.logprobs; None when no row asks
    # Structured output (engine/structured_output.py): the rows a grammar constrains and the tokens it forbids there,
    # set by the runner once the step's masks are ready; None when no row is constrained.
    grammar_rows: torch.Tensor | None = None  # [M] long
    grammar_banned: torch.Tensor | None = None  # [M, V] bool

    @classmethod
    def from_requests(
        cls,
        requests: list[Request],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: tuple[int, ...] = (),
    ) -> SamplingMetadata:
        """Batch the rows' settings. Python work is O(B + tokens); nothing loops over the vocabulary."""
        params = [r.sampling_params for r in requests]
        is_greedy = [p.is_greedy for p in params]
        random_params = [p for p, g in zip(params, is_greedy) if not g]
        top_ks = [vocab_size if g or p.top_k is None else min(p.top_k, vocab_size) for p, g in zip(params, is_greedy)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, is_greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, is_greedy)]
        random_top_ks = [k for k, g in zip(top_ks, is_greedy) if not g]
        max_top_k = max(random_top_ks) if random_top_ks and max(random_top_ks) < vocab_size else None

        def row_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        has_penalties = any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0 for p in params
        )
        penalties = _penalty_fields(requests, vocab_size, device) if has_penalties else dict.fromkeys(_PENALTY_FIELDS)
        min_rows, min_ids = _min_tokens_pairs(requests, vocab_size, eos_token_ids)
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab_size]
        return cls(
            temperature=row_tensor([1.0 if g else p.temperature for p, g in zip(params, is_greedy)], torch.float32),
            is_greedy=row_tensor(is_greedy, torch.bool),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            top_k=row_tensor(top_ks, torch.long) if any(p.top_k is not None for p in random_params) else None,
            max_top_k=max_top_k,
            top_p=row_tensor(top_ps, torch.float32) if any(p.top_p < 1.0 for p in random_params) else None,
            min_p=row_tensor(min_ps, torch.float32) if any(p.min_p > 0.0 for p in random_params) else None,
            no_penalties=not has_penalties,
            **penalties,
            min_tokens_rows=row_tensor(min_rows, torch.long) if min_rows else None,
            min_tokens_token_ids=row_tensor(min_ids, torch.long) if min_rows else None,
            logit_bias_rows=row_tensor([i for i, _, _ in bias], torch.long) if bias else None,
            logit_bias_token_ids=row_tensor([t for _, t, _ in bias], torch.long) if bias else None,
            logit_bias_values=row_tensor([b for _, _, b in bias], torch.float32) if bias else None,
            generators={
                i: r.generator for i, (r, g) in enumerate(zip(requests, is_greedy)) if r.generator is not None and not g
            },
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
        )


_PENALTY_FIELDS = (
    "presence_penalties",
    "frequency_penalties",
    "repetition_penalties",
    "output_token_counts",
    "prompt_token_mask",
)


def _penalty_fields(requests: list[Request], vocab_size: int, device: torch.device | str) -> dict:
    params = [r.sampling_params for r in requests]
    output_ids = _padded(
        [r.output_token_ids for r in requests], pad_id=vocab_size, device=device
    )  # [B, max output len]
    counts = _token_counts(output_ids, vocab_size)
    prompt_mask = None
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_ids = _padded([r.prompt_token_ids for r in requests], pad_id=vocab_size, device=device)
        prompt_mask = _token_counts(prompt_ids, vocab_size) > 0
    return dict(
        presence_penalties=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        output_token_counts=counts,
        prompt_token_mask=prompt_mask,
    )


def _padded(rows: list[list[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    """Right-pad the rows with pad_id into one [B, max len] long tensor, built in a single copy."""
    width = max((len(row) for row in rows), default=0)
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.long, device=device)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] int32 counts. The pad lands in an extra column, dropped."""
    batch_size = token_ids.shape[0]
    counts = torch.zeros(batch_size, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def _min_tokens_pairs(
    requests: list[Request], vocab_size: int, eos_token_ids: tuple[int, ...]
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to mask for rows that have fewer than min_tokens outputs. ignore_eos keeps EOS."""
    rows: list[int] = []
    token_ids: list[int] = []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
        # Ids outside the vocabulary can never be sampled, so there is nothing to mask.
        stop_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        rows.extend([i] * len(stop_ids))
        token_ids.extend(stop_ids)
    return rows, token_ids
