"""DraftProposer: draft tokens from a smaller causal LM, run autoregressively over the target's block layout.

Two kinds of draft (Leviathan et al. 2023; self-speculation as in LayerSkip, Elhoushi et al. 2024):
- a separate model with the same tokenizer: its own KV cache, indexed by the target's block ids. It catches up
  lazily: each proposal first feeds it the request's tokens it has no KV for (the prompt on the first one; after
  that at most one, the last accepted draft), so it never runs on steps where nothing is proposed;
- the target's first K layers with its final norm and head: it reads and writes the target's own cache for
  those layers, where the target has already written exactly what the draft would.
Draft KV written for draft tokens is scratch past the accepted ones: verification rewrites the target's, and a
separate draft knows which of its own it can keep by comparing what it drafted with what was accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from leanlm.config import SpeculativeConfig
from leanlm.engine.proposer import DraftJob, Drafts
from leanlm.engine.request import Request
from leanlm.engine.sampler import inverse_cdf_sample, process_logits, target_probs
from leanlm.engine.sampling_metadata import SamplingMetadata
from leanlm.kernels import cpu_decode
from leanlm.model.attention_pattern import StepPatterns
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.kv_quant import is_quantized
from leanlm.model.llama import LlamaForCausalLM
from leanlm.model.paged_kv import PagedKVCache

_DECODE_ROWS = cpu_decode.MAX_ROWS  # decode entries the native decode loop takes in one call
_CHUNK_MIN = 64  # unseen tokens past which one prefill chunk beats groups of decode entries


@dataclass
class _DraftKV:
    """What a separate draft wrote for one request: valid KV for positions < num_valid, and the tokens it
    wrote from `position` on at its last proposal (valid as far as they match the request's tokens)."""

    num_preemptions: int  # a preemption frees the blocks: the draft's KV goes with them
    num_valid: int
    position: int
    tokens: list[int]

    def valid_until(self, token_ids: list[int]) -> int:
        matched = 0
        while (
            matched < len(self.tokens)
            and self.position + matched < len(token_ids)
            and token_ids[self.position + matched] == self.tokens[matched]
        ):
            matched += 1
        return self.position + matched if matched else min(self.num_valid, self.position)


class DraftProposer:
    """A Proposer (engine/proposer.py) that runs a model."""

    writes_kv = True

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: PagedKVCache, owns_cache: bool = False, relative_cost: float = 0.0
    ) -> None:
        """`kv_cache`: a separate draft's own cache (`owns_cache`, indexed by the target's block ids), or the
        target's cache, which a self-draft reads for its layers. `relative_cost`: one draft step's cost relative
        to one target step."""
        self.model = model
        self.kv_cache = kv_cache
        # the target's runtime attention patterns (set by its runner): the draft reads the same blocks, some of
        # which a window released
        self.patterns = StepPatterns()
        self.relative_cost = relative_cost
        self.device = kv_cache.device
        self.owns_cache = owns_cache
        self.kv_cache_bytes = kv_cache.nbytes if owns_cache else 0
        self._written: dict[str, _DraftKV] = {}  # request id -> what a separate draft last wrote for it

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rotary_emb(positions, self.model.model.embed_tokens.weight.dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of the target's blocks, mirrored in a separate draft's own cache."""
        if self.owns_cache:
            self.kv_cache.copy_blocks(src, dst)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._written.pop(request_id, None)

    def observe(self, request_id, inputs, predictions, num_accepted) -> None:
        pass  # what a separate draft can keep follows from the tokens themselves (_catch_up)

    def _catch_up(self, job: DraftJob) -> int:
        """First position the draft has no valid KV for: the target's cache is the draft's for self-speculation;
        a separate draft knows what it wrote."""
        if not self.owns_cache:
            return job.position
        written = self._written.get(job.request.request_id)
        if written is None or written.num_preemptions != job.request.num_preemptions:
            return 0
        return min(written.valid_until(job.token_ids), job.position)

    @torch.inference_mode()
    def propose(self, jobs: list[DraftJob]) -> Drafts:
        """Decode every job's tokens, one batched draft step per draft position; the first step also feeds each
        job the tokens the draft has not seen yet (as decode entries when few, so it stays on the decode kernels)."""
        tokens: list[list[int]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        starts = [self._catch_up(job) for job in jobs]
        for job, start in zip(jobs, starts):
            self._feed_backlog(job, start)
        # step 0: the newest token, after the last few unseen ones
        inputs = [job.token_ids[max(start, job.position - _DECODE_ROWS + 1) :] for job, start in zip(jobs, starts)]
        num_steps = max((job.num_tokens for job in jobs), default=0)
        for step in range(num_steps):
            if step == 1:
                started = time.perf_counter()
            active = [i for i, job in enumerate(jobs) if job.num_tokens > step]
            first = [jobs[i].position + step - len(inputs[i]) + 1 for i in active]
            logits = self._forward([inputs[i] for i in active], first, [jobs[i].block_ids for i in active])
            requests = [jobs[i].request for i in active]
            sampled, q = self._sample(logits, requests)
            for row, i in enumerate(active):
                tokens[i].append(sampled[row])
                inputs[i] = [sampled[row]]
                if q is not None and not requests[row].sampling_params.is_greedy:
                    probs[i].append(q[row])
        if self.owns_cache:
            for job, drafted in zip(jobs, tokens):
                # KV now valid below `position`; from it on, the newest token then all drafts but the last
                written = [job.token_ids[-1], *drafted[:-1]]
                self._written[job.request.request_id] = _DraftKV(
                    job.request.num_preemptions, job.position, job.position, written
                )
        step_seconds = (time.perf_counter() - started) / (num_steps - 1) if num_steps > 1 else None
        return Drafts(tokens, [torch.stack(p) if p else None for p in probs], step_seconds)

    def _feed_backlog(self, job: DraftJob, start: int) -> None:
        """Write the draft KV of a long run of unseen tokens (a prompt; the output of a stretch without drafts)
        before the batched steps: one chunk when long, else groups of decode entries the native loop takes."""
        end = max(start, job.position - _DECODE_ROWS + 1)  # the last few go with the first step
        while start < end:
            size = end - start if end - start > _CHUNK_MIN else min(_DECODE_ROWS, end - start)
            self._forward([job.token_ids[start : start + size]], [start], [job.block_ids], logits=False)
            start += size

    def _forward(
        self, inputs: list[list[int]], first_positions: list[int], block_ids: list[list[int]], logits: bool = True
    ) -> torch.Tensor | None:
        """Logits [B, V] after each request's input run (its tokens at first_position on)."""
        query_lens, seq_lens, blocks, ids, positions, last_rows = [], [], [], [], [], []
        for tokens, first, table in zip(inputs, first_positions, block_ids):
            if len(tokens) <= _DECODE_ROWS:  # one decode entry per token: the draft's native decode loop applies
                query_lens += [1] * len(tokens)
                seq_lens += range(first + 1, first + len(tokens) + 1)
                blocks += [table] * len(tokens)
            else:  # a prompt to catch up on: one chunk
                query_lens.append(len(tokens))
                seq_lens.append(first + len(tokens))
                blocks.append(table)
            ids += tokens
            positions += range(first, first + len(tokens))
            last_rows.append(len(ids) - 1)
        if self.patterns.decode is not None:
            self.model.rotary_emb.ensure(max(seq_lens))
        ctx = build_forward_context(query_lens, seq_lens, blocks, self.kv_cache, self.patterns, self._rotary)
        as_long = dict(dtype=torch.long, device=self.device)
        with forward_context(ctx):
            hidden = self.model(torch.tensor(ids, **as_long), torch.tensor(positions, **as_long))  # [T, hidden]
        return self.model.compute_logits(hidden[last_rows]).float() if logits else None  # [B, V]

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
        sampled = torch.where(metadata.is_greedy, greedy, inverse_cdf_sample(q, metadata.generators))
        return sampled.tolist(), q


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: parameters and buffers (quantized layers keep their weights in buffers),
    without the rotary tables."""
    tensors = [*model.parameters(), *(b for name, b in model.named_buffers() if "rotary" not in name)]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _early_exit(
    spec: SpeculativeConfig, target: LlamaForCausalLM, target_cache: PagedKVCache, draft_model: LlamaForCausalLM | None
) -> DraftProposer:
    """Self-speculation: the target's first layers, reading the target's cache for them."""
    relative_cost = spec.num_draft_layers / target.config.num_hidden_layers
    return DraftProposer(target.first_layers(spec.num_draft_layers), target_cache, relative_cost=relative_cost)


def _separate(
    spec: SpeculativeConfig, target: LlamaForCausalLM, target_cache: PagedKVCache, draft_model: LlamaForCausalLM | None
) -> DraftProposer:
    """A smaller model with the target's tokenizer, on a cache of its own indexed by the target's block ids (in
    the target's KV dtype, or its own weight dtype when the target's cache is 8-bit)."""
    if draft_model is None:
        raise ValueError("speculative 'draft' needs the draft model: load it with LLM(speculative='draft:MODEL')")
    if draft_model.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_model.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); a draft must share the target's tokenizer"
        )
    dtype = target_cache.dtype if not is_quantized(target_cache.dtype) else draft_model.model.norm.weight.dtype
    cfg = draft_model.config
    cache = PagedKVCache.allocate(
        cfg.num_hidden_layers,
        target_cache.num_blocks,
        cfg.cache_kv_heads,
        target_cache.block_size,
        cfg.cache_head_dim,
        dtype,
        target_cache.device,
    )
    relative_cost = _weight_bytes(draft_model) / _weight_bytes(target)
    return DraftProposer(draft_model, cache, owns_cache=True, relative_cost=relative_cost)


# The model proposers by SpeculativeConfig.method (the text ones are proposer.TEXT_PROPOSERS).
MODEL_PROPOSERS = {"self": _early_exit, "draft": _separate}


def model_proposer(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_cache: PagedKVCache,
    draft_model: LlamaForCausalLM | None = None,
) -> DraftProposer:
    """The DraftProposer a `self` or `draft` method runs, over the target's KV cache layout."""
    return MODEL_PROPOSERS[spec.method](spec, target, target_cache, draft_model)
