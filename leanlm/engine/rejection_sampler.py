"""RejectionSampler: verifies draft tokens against the target model in one pass over their rows (speculative
sampling, Leviathan et al. 2023 / Chen et al. 2023). Greedy rows keep the longest prefix equal to the target's
argmax; random rows accept draft x with probability min(1, p(x) / q(x)) and replace the first rejected one by
a sample of max(0, p - q) normalized, which leaves every output token distributed exactly as the target's p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.engine.sampler import (
    LogprobsTensors,
    gather_logprobs,
    inverse_cdf_sample,
    process_logits,
    target_probs,
)
from leanlm.engine.sampling_metadata import SamplingMetadata


@dataclass
class VerifyOutput:
    """Per request: the accepted drafts followed by one token sampled from the target (the replacement of
    the first rejected draft, or the bonus token after all of them)."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # per request: drafts accepted
    predictions: list[list[int]]  # per request: the target's argmax at each of its rows (Jacobi iterates)
    logprobs: LogprobsTensors | None  # per row (all requests' rows, in order), scored against the raw logits


class RejectionSampler:
    """Stateless. Request i owns len(draft_token_ids[i]) + 1 consecutive rows of the logits: row j is the
    target's distribution for the token after draft j - 1 (row 0 follows the request's last real token)."""

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32, raw target logits, N = sum(len(d) + 1)
        metadata: SamplingMetadata,  # N rows: each request's settings repeated over its rows
        draft_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None = None,  # [N, V] the draft's distribution per row (zeros on bonus
        # rows); None for proposers whose drafts are certain (n-gram lookup: q is a point mass)
    ) -> VerifyOutput:
        device = logits.device
        num_rows = logits.shape[0]
        counts = [len(d) + 1 for d in draft_token_ids]
        if sum(counts) != num_rows:
            raise ValueError(f"{num_rows} logit rows for drafts needing {sum(counts)}")
        # Row r's draft token; bonus rows have none (-1) and always take the sampled replacement.
        drafts = torch.tensor([t for d in draft_token_ids for t in [*d, -1]], dtype=torch.long, device=device)  # [N]
        has_draft = drafts >= 0  # [N]
        safe_drafts = drafts.clamp_min(0).unsqueeze(1)  # [N, 1]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if metadata.max_num_logprobs is not None else None
        processed = process_logits(logits, metadata)  # [N, V]
        greedy = processed.argmax(dim=-1)  # [N]
        accept = has_draft & (drafts == greedy)  # greedy rule; random rows overwritten below
        replacement = greedy
        if not metadata.all_greedy:
            p = target_probs(processed, metadata)
            p = p / p.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalized
            if draft_probs is None:
                q_draft = has_draft.float().unsqueeze(1)  # [N, 1] q(x) = 1 for a certain draft
                residual = p.scatter(1, safe_drafts, 0.0)
                residual = torch.where(has_draft.unsqueeze(1), residual, p)
            else:
                q_draft = draft_probs.gather(1, safe_drafts)  # [N, 1]
                residual = torch.where(has_draft.unsqueeze(1), (p - draft_probs).clamp_min(0.0), p)
            p_draft = p.gather(1, safe_drafts)  # [N, 1]
            ratio = (p_draft / q_draft.clamp_min(torch.finfo(torch.float32).tiny)).squeeze(1)  # [N]
            random_accept = has_draft & (self._uniforms(num_rows, metadata, device) < ratio)
            # A residual that is all zero (p == q) is never sampled: its row always accepts.
            random_replacement = inverse_cdf_sample(residual, metadata.generators)
            accept = torch.where(metadata.is_greedy, accept, random_accept)
            replacement = torch.where(metadata.is_greedy, greedy, random_replacement)
        row_tokens = torch.where(accept, drafts, replacement)  # [N]: the token each row emits if reached
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, row_tokens, metadata.max_num_logprobs)
        return self._assemble(accept.tolist(), row_tokens.tolist(), greedy.tolist(), counts, logprobs)

    @staticmethod
    def _uniforms(num_rows: int, metadata: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """U[0, 1) per row; seeded rows draw from their own generator so batching does not change them."""
        u = torch.rand(num_rows, device=device)
        for row, generator in metadata.generators.items():
            u[row] = torch.rand(1, device=device, generator=generator)
        return u

    @staticmethod
    def _assemble(
        accept: list[bool],
        row_tokens: list[int],
        greedy: list[int],
        counts: list[int],
        logprobs: LogprobsTensors | None,
    ) -> VerifyOutput:
        token_ids, num_accepted, predictions = [], [], []
        start = 0
        for count in counts:
            num = 0
            while num < count - 1 and accept[start + num]:
                num += 1
            token_ids.append(row_tokens[start : start + num + 1])
            num_accepted.append(num)
            predictions.append(greedy[start : start + count])
            start += count
        return VerifyOutput(token_ids, num_accepted, predictions, logprobs)
