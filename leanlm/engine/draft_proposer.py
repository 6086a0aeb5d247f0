"""DraftProposer: draft tokens from a smaller causal LM, run autoregressively over the target's block layout.

Two kinds of draft (Leviathan et al. 2023; self-speculation as in LayerSkip, Elhoushi et al. 2024):
- a separate model with the same tokenizer: its own KV cache, indexed by the target's block ids, kept in step
  by running it over every batch the target runs (`follow`);
- the target's first K layers with its final norm and head: it reads and writes the target's own cache for
  those layers, where the target has already written exactly what the draft would.
Draft KV written for draft tokens is scratch: the target's verification step rewrites those slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.engine.request import Request
from leanlm.engine.sampler import exponential_race, process_logits, target_probs
from leanlm.engine.sampling_metadata import SamplingMetadata
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.llama import LlamaForCausalLM


@dataclass
class DraftJob:
    """One request's proposal: continue from `token_id` at `position` for `num_tokens` tokens."""

    request: Request
    token_id: int  # the request's last token (sampled this step, KV not yet written)
    position: int
    num_tokens: int
    block_ids: list[int]  # covering position + num_tokens - 1


@dataclass
class Drafts:
    token_ids: list[list[int]]  # per job
    probs: list[torch.Tensor | None]  # per job: [num_tokens, V] the draft distribution behind each random
    # request's tokens; None for greedy requests (their drafts are the draft's argmax)


class DraftProposer:
    def __init__(self, model: LlamaForCausalLM, block_size: int, device: torch.device,
                 num_blocks: int | None = None, dtype: torch.dtype | None = None) -> None:
        """`num_blocks` given: a separate draft with its own cache of that many blocks (the target's count)
        in `dtype`; None: the model already reads a bound cache (self-speculation)."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.num_kv_heads = model.config.num_key_value_heads
        self.owns_cache = num_blocks is not None
        self.kv_cache_bytes = 0
        if self.owns_cache:
            cfg = model.config
            shape = (cfg.num_hidden_layers, 2, num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim)
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, 2, N, Hkv, bs, D]
            model.bind_kv_cache([(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(shape[0])])
            self.kv_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of the target's blocks, mirrored in a separate draft's own cache."""
        if self.owns_cache:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [L, 2, n, Hkv, bs, D]

    @torch.inference_mode()
    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, query_lens: list[int], seq_lens: list[int],
               block_ids: list[list[int]]) -> None:
        """Run a separate draft over the target's batch so its cache holds every token the target's does."""
        if not self.owns_cache:
            return
        ctx = build_forward_context(query_lens, seq_lens, block_ids, self.block_size, self.num_kv_heads, self.device)
        with forward_context(ctx):
            self.model(input_ids, positions)

    @torch.inference_mode()
    def propose(self, jobs: list[DraftJob]) -> Drafts:
        """Decode every job's tokens, one batched draft step per draft position."""
        tokens: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        last = [job.token_id for job in jobs]
        for step in range(max((job.num_tokens for job in jobs), default=0)):
            active = [i for i, job in enumerate(jobs) if job.num_tokens > step]
            positions = [jobs[i].position + step for i in active]
            ctx = build_forward_context([1] * len(active), [p + 1 for p in positions],
                                        [jobs[i].block_ids for i in active], self.block_size, self.num_kv_heads,
                                        self.device)  # fmt: skip
            as_long = dict(dtype=torch.long, device=self.device)
            with forward_context(ctx):
                hidden = self.model(torch.tensor([last[i] for i in active], **as_long),
                                    torch.tensor(positions, **as_long))  # fmt: skip
            logits = self.model.compute_logits(hidden).float()  # [B, V]
            requests = [jobs[i].request for i in active]
            sampled, q = self._sample(logits, requests)
            for row, i in enumerate(active):
                tokens[i].append(sampled[row])
                last[i] = sampled[row]
                if q is not None and not requests[row].sampling_params.is_greedy:
                    probs[i].append(q[row])
        return Drafts(tokens, [torch.stack(p) if p else None for p in probs])

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], torch.Tensor | None]:
        """Each request's own settings applied to the draft's logits: greedy rows take the argmax, random rows
        sample from q, which verification needs back (rows [B, V], normalized)."""
        vocab_size = logits.shape[-1]
        metadata = SamplingMetadata.from_requests(requests, vocab_size, self.device)
        processed = process_logits(logits, metadata)
        greedy = processed.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy.tolist(), None
        q = target_probs(processed, metadata)
        q = q / q.sum(dim=-1, keepdim=True)
        sampled = torch.where(metadata.is_greedy, greedy, exponential_race(q, metadata.generators))
        return sampled.tolist(), q
