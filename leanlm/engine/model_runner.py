"""ModelRunner: owns the paged KV tensors, turns a SchedulerOutput into one flat forward, samples.

Rows sample only when their scheduled chunk reaches the request's last token; prompt logprobs are scored
from the same forward (logits at position p against prompt token p+1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from leanlm.config import EngineConfig, ModelConfig
from leanlm.engine.draft_proposer import DraftProposer, model_proposer
from leanlm.engine.early_exit import EarlyExit
from leanlm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from leanlm.engine.rejection_sampler import RejectionSampler
from leanlm.engine.request import Request
from leanlm.engine.sampler import Sampler, SamplingMetadata, gather_logprobs, logprobs_to_dicts
from leanlm.engine.spec_decode import SpecDecoder
from leanlm.engine.swap_space import HostKVPool
from leanlm.model.context import build_forward_context, forward_context
from leanlm.model.kv_quant import SCALE_DTYPE, is_quantized, kv_storage_dtype
from leanlm.model.llama import LlamaForCausalLM
from leanlm.model.paged_kv import PagedKVCache


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block: 2 * L * block_size * Hkv * (D * element size + scale bytes), where an
    8-bit cache (int8/fp8) keeps one float32 scale per (token, KV head) and a float cache none."""
    element = torch.empty(0, dtype=dtype).element_size()
    scale = torch.empty(0, dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * (config.head_dim * element + scale)


def num_kv_blocks_for(config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype) -> int:
    if engine_config.num_kv_blocks is not None:
        return engine_config.num_kv_blocks
    per_block = kv_cache_bytes_per_block(config, engine_config.block_size, dtype)
    num_blocks = engine_config.kv_cache_memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={engine_config.kv_cache_memory_bytes} holds no KV block "
            f"(one block needs {per_block} bytes); raise it or set num_kv_blocks"
        )
    return num_blocks


@dataclass(frozen=True)
class _BatchLayout:
    """Where each scheduled request sits in the flat batch."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    query_lens: list[int]  # per request
    row_starts: list[int]  # per request: its first row in the batch
    seq_lens: list[int]  # per request: tokens with KV after this step
    sample_rows: list[int]  # requests whose chunk ends at their last token (and drafts, if any)
    sample_token_idx: list[int]  # batch rows that give logits: per sampling request, its last token's row
    # and its drafts' rows (1 + drafts rows each, consecutive)


def _attention_entries(so: SchedulerOutput, layout: _BatchLayout) -> tuple[list[int], list[int], list[list[int]]]:
    """(query_lens, seq_lens, block_ids) for the forward context. A request verifying drafts enters as one
    decode entry per token (token j sees the cache up to itself): the same causal attention as a chunk, but
    every row is computed exactly as a plain decode step computes it, so greedy speculation reproduces plain
    greedy decoding token for token, and the batch can stay on the decode kernels."""
    if not any(so.spec_token_ids):
        return layout.query_lens, layout.seq_lens, so.block_ids
    query_lens, seq_lens, block_ids = [], [], []
    for i, (n, seq_len, blocks) in enumerate(zip(layout.query_lens, layout.seq_lens, so.block_ids)):
        if so.num_spec_tokens(i):
            query_lens += [1] * n
            seq_lens += range(seq_len - n + 1, seq_len + 1)
            block_ids += [blocks] * n
        else:
            query_lens.append(n)
            seq_lens.append(seq_len)
            block_ids.append(blocks)
    return query_lens, seq_lens, block_ids


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        engine_config: EngineConfig,
        device: torch.device,
        model_dtype: torch.dtype,
        draft_model: LlamaForCausalLM | None = None,  # speculative 'draft': the model that proposes
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.block_size = engine_config.block_size
        self.device = device
        self.kv_cache_dtype = kv_storage_dtype(engine_config.kv_cache_dtype, model_dtype)
        self.num_blocks = num_kv_blocks_for(self.config, engine_config, self.kv_cache_dtype)
        # This runner's cache, handed to every forward it runs (the model holds none): [L, 2, N, Hkv, bs, D], and
        # an 8-bit cache's per-(token, KV head) scales [L, 2, N, Hkv, bs].
        cfg = self.config
        self.kv_cache = PagedKVCache.allocate(
            cfg.num_hidden_layers,
            self.num_blocks,
            cfg.num_key_value_heads,
            self.block_size,
            cfg.head_dim,
            self.kv_cache_dtype,
            device,
        )
        self.kv_cache_bytes = self.kv_cache.nbytes
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.spec_decoder = self._spec_decoder(engine_config, draft_model, max_model_len)
        exits = engine_config.early_exit
        self.early_exit = EarlyExit(model, exits) if exits is not None else None  # CALM, decode steps only
        # Swap preemption's host copies of every cache indexed by this runner's block ids (a separate draft's too)
        swap_bytes = engine_config.swap_space_bytes
        self.host_kv_pool = HostKVPool.sized(self.own_caches(), swap_bytes) if engine_config.can_swap else None

    def _spec_decoder(
        self, engine_config: EngineConfig, draft_model: LlamaForCausalLM | None, max_model_len: int | None
    ) -> SpecDecoder | None:
        spec = engine_config.speculative
        if spec is None:
            return None
        proposer = model_proposer(spec, self.model, self.kv_cache, draft_model) if spec.uses_model else None
        if proposer is not None:
            self.kv_cache_bytes += proposer.kv_cache_bytes  # a separate draft's own cache
        return SpecDecoder(spec, proposer, self.block_size, max_model_len)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        requests = scheduler_output.scheduled_requests
        self._swap_blocks(scheduler_output)  # swap preemption's copies, before copy-on-write reuses a freed block
        self._copy_blocks(scheduler_output.blocks_to_copy)  # copy-on-write, before the forward writes
        if not requests:
            return ModelRunnerOutput([], [], [])
        layout = self._layout(scheduler_output)
        entries = _attention_entries(scheduler_output, layout)
        ctx = build_forward_context(*entries, self.kv_cache)
        started = time.perf_counter()
        exit_logits = None  # [T, V] when an early exit answered the step
        with forward_context(ctx):
            if self.early_exit is not None and ctx.is_all_decode:
                hidden, exit_logits = self.early_exit.forward(layout.input_ids, layout.positions, ctx)
            else:
                hidden = self.model(layout.input_ids, layout.positions)  # [T, hidden]
        if self.spec_decoder is not None and ctx.is_all_decode:
            self.spec_decoder.record_target_step(time.perf_counter() - started)

        sampled: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[dict[int, float]] | None] = [None] * len(requests)
        if layout.sample_rows:
            # [rows, V] in the model's dtype: the sampler copies to float32 only where it edits or normalizes
            # (a fresh [64, 49152] float32 copy took 2-10 ms a step, mostly page faults on new memory)
            if exit_logits is not None:
                logits = exit_logits[layout.sample_token_idx]
            else:
                logits = self.model.compute_logits(hidden[layout.sample_token_idx])
            self._sample(scheduler_output, layout.sample_rows, logits, sampled, logprobs)
        scored = [
            self._prompt_logprobs(r, n, hidden, start)
            for r, n, start in zip(requests, layout.query_lens, layout.row_starts)
        ]
        prompt_logprobs = [entries for entries, _ in scored]
        prompt_logprobs_full = [full for _, full in scored]
        spec_token_ids = None
        if self.spec_decoder is not None:
            self.spec_decoder.forget(scheduler_output.finished_request_ids)
            spec_token_ids = self.spec_decoder.propose(requests, sampled, scheduler_output.block_ids)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, prompt_logprobs_full, spec_token_ids)

    def _sample(
        self,
        so: SchedulerOutput,
        sample_rows: list[int],
        logits: torch.Tensor,
        sampled: list[list[int]],
        logprobs: list[list[dict[int, float]] | None],
    ) -> None:
        """Fill `sampled` and `logprobs` for the sampling requests from their logit rows: one token each, or,
        in a step that verifies drafts, the accepted drafts plus one token each."""
        sample_reqs = [so.scheduled_requests[i] for i in sample_rows]
        drafts = [so.spec_token_ids[i] if so.spec_token_ids else [] for i in sample_rows]
        rows_per_req = [len(d) + 1 for d in drafts]
        row_reqs = [r for r, n in zip(sample_reqs, rows_per_req) for _ in range(n)]
        metadata = SamplingMetadata.from_requests(
            row_reqs, self.config.vocab_size, self.device, self.config.eos_token_ids
        )
        if len(row_reqs) == len(sample_reqs):  # no drafts: one row per request
            out = self.sampler(logits, metadata)
            token_ids = [[t] for t in out.sampled_token_ids.tolist()]
            lp = out.logprobs
        else:
            draft_probs = self.spec_decoder.draft_probs(sample_reqs, drafts)
            verified = self.rejection_sampler(logits.float(), metadata, drafts, draft_probs)
            token_ids, lp = verified.token_ids, verified.logprobs
            self.spec_decoder.observe(sample_reqs, drafts, verified.num_accepted, verified.predictions)
        lp_dicts = None
        if lp is not None:
            lp_dicts = logprobs_to_dicts(lp, [r.sampling_params.logprobs or 0 for r in row_reqs])
        first_row = 0
        for j, row in enumerate(sample_rows):
            sampled[row] = token_ids[j]
            if lp_dicts is not None and sample_reqs[j].sampling_params.logprobs is not None:
                logprobs[row] = lp_dicts[first_row : first_row + len(token_ids[j])]
            first_row += rows_per_req[j]

    def _copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """KV (and 8-bit scales) of block src into block dst, in every layer, for each (src, dst) pair."""
        if not blocks_to_copy:
            return
        src, dst = (torch.tensor(ids, dtype=torch.long, device=self.device) for ids in zip(*blocks_to_copy))
        self.kv_cache.copy_blocks(src, dst)
        if self.spec_decoder is not None:
            self.spec_decoder.proposer.copy_blocks(src, dst)  # a draft model's own cache mirrors the block ids

    def own_caches(self) -> tuple[PagedKVCache, ...]:
        """The caches this runner allocated over its block ids: its own, and a separate draft model's."""
        proposer = self.spec_decoder.proposer if self.spec_decoder is not None else None
        draft = (proposer.kv_cache,) if isinstance(proposer, DraftProposer) and proposer.owns_cache else ()
        return (self.kv_cache, *draft)

    def _swap_blocks(self, so: SchedulerOutput) -> None:
        """Preempted requests' private blocks out to host memory, swapped ones back (every cache, scales too)."""
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            self.host_kv_pool.swap(so.blocks_to_swap_out, so.blocks_to_swap_in)

    def _layout(self, so: SchedulerOutput) -> _BatchLayout:
        ids: list[int] = []
        positions: list[int] = []
        seq_lens, sample_rows, sample_idx, row_starts = [], [], [], []
        for i, (req, n) in enumerate(zip(so.scheduled_requests, so.num_scheduled_tokens)):
            row_starts.append(len(ids))
            start = req.num_computed_tokens
            num_drafts = so.num_spec_tokens(i)
            ids.extend(req.all_token_ids[start : start + n - num_drafts])
            if num_drafts:
                ids.extend(so.spec_token_ids[i])  # drafts follow the last real token
            positions.extend(range(start, start + n))
            seq_lens.append(start + n)
            if start + n - num_drafts == req.num_tokens:
                sample_rows.append(i)
                sample_idx.extend(range(len(ids) - 1 - num_drafts, len(ids)))
        as_long = dict(dtype=torch.long, device=self.device)
        return _BatchLayout(
            input_ids=torch.tensor(ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            query_lens=list(so.num_scheduled_tokens),
            row_starts=row_starts,
            seq_lens=seq_lens,
            sample_rows=sample_rows,
            sample_token_idx=sample_idx,
        )

    def _prompt_logprobs(
        self, req: Request, num_new: int, hidden: torch.Tensor, row_start: int
    ) -> tuple[list[dict[int, float] | None] | None, torch.Tensor | None]:
        """Entries for prompt indices not yet recorded (a preempted request recomputes its prompt), and with
        full_prompt_logprobs the whole log-softmax behind them ([n, V] float32 on CPU, one row per non-None
        entry). Entry j scores prompt token j from position j-1; entry 0 is None. (None, None) when nothing is due.
        """
        k = req.sampling_params.prompt_logprobs
        if k is None:
            return None, None
        full = None
        start = req.num_computed_tokens
        first_entry = len(req.prompt_logprobs)  # next prompt index to record
        last_entry = min(start + num_new, req.num_prompt_tokens - 1)  # positions < P-1 score a prompt token
        entries: list[dict[int, float] | None] = []
        if first_entry == 0 and start == 0:
            entries.append(None)
            first_entry = 1
        # entry j comes from position j-1, which must lie in this chunk [start, start + num_new)
        first_entry = max(first_entry, start + 1)
        if first_entry <= last_entry:
            positions = torch.arange(first_entry - 1, last_entry, device=self.device)
            rows = row_start + (positions - start)
            logits = self.model.compute_logits(hidden[rows]).float()  # [Np, V]
            targets = torch.tensor(req.prompt_token_ids[first_entry : last_entry + 1], device=self.device)
            all_logprobs = torch.log_softmax(logits, dim=-1)  # [Np, V]
            lp = gather_logprobs(all_logprobs, targets, k)
            entries.extend(logprobs_to_dicts(lp, [k] * len(targets)))
            if req.sampling_params.full_prompt_logprobs:
                full = all_logprobs.cpu()
        return entries or None, full
