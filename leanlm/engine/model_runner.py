"""ModelRunner: owns the paged KV tensors, turns a SchedulerOutput into one flat forward, samples.

Rows sample only when their scheduled chunk reaches the request's last token; prompt logprobs are scored
from the same forward (logits at position p against prompt token p+1).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from leanlm.config import EngineConfig, ModelConfig
from leanlm.engine.draft_proposer import DraftProposer, model_proposer
from leanlm.engine.early_exit import EarlyExit
from leanlm.engine.kv_budget import KVBudget
from leanlm.engine.kv_evictor import KVEvictor
from leanlm.engine.lora_manager import LoRAManager
from leanlm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from leanlm.engine.rejection_sampler import RejectionSampler
from leanlm.engine.request import Request
from leanlm.engine.sampler import Sampler, SamplingMetadata, gather_logprobs, logprobs_to_dicts
from leanlm.engine.spec_decode import SpecDecoder
from leanlm.engine.step_plan import PromptRows, StepOutput, StepPlan, plan_step, split_microbatches
from leanlm.engine.structured_output import GrammarMask, StructuredOutput
from leanlm.engine.swap_space import HostKVPool
from leanlm.model.attention_pattern import StepPatterns
from leanlm.model.context import ExpertRouting, ForwardContext, build_forward_context, forward_context
from leanlm.model.kv_quant import SCALE_DTYPE, is_quantized, kv_storage_dtype
from leanlm.model.linear.act_quant import activation_quant, resolve_activation_quant
from leanlm.model.llama import LlamaForCausalLM
from leanlm.model.lora import LoRAMapping
from leanlm.model.paged_kv import PagedKVCache


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block: 2 * L * block_size * Hkv * (D * element size + scale bytes), where an
    8-bit cache (int8/fp8) keeps one float32 scale per (token, KV head) and a float cache none."""
    element = torch.empty(0, dtype=dtype).element_size()
    scale = torch.empty(0, dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    heads, head_dim = config.cache_kv_heads, config.cache_head_dim  # MLA: one latent row per token, split in two
    return 2 * config.num_hidden_layers * block_size * heads * (head_dim * element + scale)


def _check_long_context(config: ModelConfig, engine_config: EngineConfig) -> None:
    """Refuse, before anything is allocated, runtime attention sinks on a model whose attention cannot re-rotate a
    query for them: MLA's shared rotary key, and Gemma 2's soft-capped scores (attended outside the paged backends)."""
    if engine_config.long_context.attention_sinks and (
        config.mla is not None or config.attn_logit_softcapping is not None
    ):
        raise ValueError(
            f"attention_sinks are not supported for {config.architecture} (its attention cannot re-rotate a query for "
            "the sinks); use attention_window alone, or no runtime long-context pattern"
        )


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
        _check_long_context(self.config, engine_config)
        # W4A8 / W8A8-dynamic: the mode every step runs in (the layers hold none), and how many layers it changes
        self.act_quant, self.act_quant_layers = resolve_activation_quant(model, engine_config.act_quant)
        self.block_size = engine_config.block_size
        self.model_dtype = model_dtype  # the compute dtype (a pipeline stage past the first has no embeddings)
        self.device = device
        self.kv_cache_dtype = kv_storage_dtype(engine_config.kv_cache_dtype, model_dtype)
        self.num_blocks = num_kv_blocks_for(self.config, engine_config, self.kv_cache_dtype)
        # This runner's cache, handed to every forward it runs (the model holds none): [L, 2, N, Hkv, bs, D], and
        # an 8-bit cache's per-(token, KV head) scales [L, 2, N, Hkv, bs].
        cfg = self.config
        self.kv_cache = PagedKVCache.allocate(
            cfg.num_hidden_layers,
            self.num_blocks,
            cfg.cache_kv_heads,
            self.block_size,
            cfg.cache_head_dim,
            self.kv_cache_dtype,
            device,
        )
        self.kv_cache_bytes = self.kv_cache.nbytes
        # long inputs: the runtime attention patterns every forward carries (windows, sinks, prefill patterns)
        self.patterns = StepPatterns.of(engine_config.long_context)
        self.routing_policy = engine_config.routing_policy()  # MoE capacity / BPR, handed to every forward
        self.streams = engine_config.long_context.streams  # positions may run past the rotary table: grow it
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.spec_decoder = self._spec_decoder(engine_config, draft_model, max_model_len)
        self.structured_output = StructuredOutput(self.config.vocab_size, max_model_len)  # grammar masks, jump-forward
        exits = engine_config.early_exit
        self.early_exit = EarlyExit(model, exits) if exits is not None else None  # CALM, decode steps only
        # plans -> their outputs (logits [R, V], pooled rows) each: this process's forwards, or (leanlm.parallel) the
        # plans run by every rank
        self.step_forward: Callable[[list[StepPlan]], list[StepOutput]] = self.forward_all
        self.num_microbatches = 1  # parts a step is split into (a pipeline keeps several in flight)
        # Swap preemption's host copies of every cache indexed by this runner's block ids (a separate draft's too)
        swap_bytes = engine_config.swap_space_bytes
        self.host_kv_pool = HostKVPool.sized(self.own_caches(), swap_bytes) if engine_config.can_swap else None
        budget = KVBudget.of(engine_config.long_context, self.block_size)  # H2O / SnapKV scoring and compaction
        heads = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.cache_kv_heads, cfg.cache_head_dim)
        self.kv_evictor = KVEvictor(budget, *heads, device) if budget is not None else None
        # LoRA adapters' slots (set by LLMEngine, which knows the running requests); None: base model only
        self.lora: LoRAManager | None = None

    def _spec_decoder(
        self, engine_config: EngineConfig, draft_model: LlamaForCausalLM | None, max_model_len: int | None
    ) -> SpecDecoder | None:
        spec = engine_config.speculative
        if spec is None:
            return None
        proposer = model_proposer(spec, self.model, self.kv_cache, draft_model) if spec.uses_model else None
        if proposer is not None:
            proposer.patterns = self.patterns
        if proposer is not None:
            self.kv_cache_bytes += proposer.kv_cache_bytes  # a separate draft's own cache
        return SpecDecoder(spec, proposer, self.block_size, max_model_len)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with activation_quant(self.act_quant):  # every forward of the step: the target's, a draft's, a pipeline's
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        requests = scheduler_output.scheduled_requests
        if self.kv_evictor is not None:  # evictions before anything else moves or writes KV
            self.kv_evictor.compact(scheduler_output.kv_compactions, self.kv_cache)
            self.kv_evictor.start_step(scheduler_output)
        if not requests:
            so = scheduler_output
            if so.blocks_to_copy or so.blocks_to_swap_out or so.blocks_to_swap_in:  # on every rank
                self.step_forward([StepPlan.copies_only(so, self.device)])
            return ModelRunnerOutput([], [], [])
        # one part, or (pipeline parallelism) micro-batches of consecutive requests, in flight together
        parts = split_microbatches(scheduler_output, self.num_microbatches)
        planned = [plan_step(part, self.device) for part in parts]
        if self.lora is not None:  # each request's rows to its adapter's slot
            planned = self.lora.attach(parts, planned)
        # constrained rows' token masks, computed in a thread while the forward runs (None: no row is constrained)
        masks = [self._start_masks(part, step.sample_rows) for part, step in zip(parts, planned)]
        outputs = self.step_forward([p.plan for p in planned])
        sampled: list[list[int]] = []
        logprobs: list[list[dict[int, float]] | None] = []
        pooled: list[torch.Tensor | None] = []
        errors: list[str | None] = []
        scored = []
        for part, step, output, mask in zip(parts, planned, outputs, masks):
            part_logits = output.logits  # [R, V] in the model's dtype
            part_sampled: list[list[int]] = [[] for _ in part.scheduled_requests]
            part_logprobs: list[list[dict[int, float]] | None] = [None] * len(part.scheduled_requests)
            part_errors: list[str | None] = [None] * len(part.scheduled_requests)
            if step.sample_rows:
                # [rows, V] in the model's dtype: the sampler copies to float32 only where it edits or normalizes
                # (a fresh [64, 49152] float32 copy took 2-10 ms a step, mostly page faults on new memory)
                sample_logits = part_logits[: step.plan.num_sample_rows]
                self._sample(part, step.sample_rows, sample_logits, part_sampled, part_logprobs, mask, part_errors)
            sampled += part_sampled
            logprobs += part_logprobs
            pooled += _pooled_per_request(len(part.scheduled_requests), step.pool_requests, output.pooled)
            errors += part_errors
            prompt_logits = part_logits[step.plan.num_sample_rows :]
            scored += _prompt_logprobs(part.scheduled_requests, step.prompt_rows, prompt_logits)
        prompt_logprobs = [entries for entries, _ in scored]
        prompt_logprobs_full = [full for _, full in scored]
        spec_token_ids = None
        if self.spec_decoder is not None:
            self.spec_decoder.forget(scheduler_output.finished_request_ids)
            spec_token_ids = self.spec_decoder.propose(requests, sampled, scheduler_output.block_ids)
            self.structured_output.trim_drafts(requests, spec_token_ids)
        pooled_out = pooled if any(p is not None for p in pooled) else None
        return ModelRunnerOutput(
            sampled,
            logprobs,
            prompt_logprobs,
            prompt_logprobs_full,
            spec_token_ids,
            pooled_out,
            errors if any(errors) else None,
        )

    def _start_masks(self, so: SchedulerOutput, sample_rows: list[int]) -> Future[GrammarMask] | None:
        requests = [so.scheduled_requests[i] for i in sample_rows]
        drafts = [so.spec_token_ids[i] if so.spec_token_ids else [] for i in sample_rows]
        return self.structured_output.start_masks(requests, drafts)

    def forward_all(self, plans: list[StepPlan]) -> list[StepOutput]:
        """The plans' forwards, one after the other, on this process alone."""
        return [self.forward(plan) for plan in plans]

    def forward(self, plan: StepPlan) -> StepOutput:
        """Run one step's forward on this process's model and cache: the copy-on-write copies, the layers, the
        logits of plan.logit_rows [R, V] and the pooled rows of plan.pool_segments. Every rank of a parallel model
        runs it on the same plan."""
        self.move_blocks(plan)
        if not plan.num_tokens:
            return StepOutput(torch.zeros(0, self.config.vocab_size, device=self.device))
        ctx = self.context_for(plan)
        if plan.lora_runs:
            ctx = dataclasses.replace(ctx, lora=LoRAMapping.of(self.lora.slots, plan.lora_runs, plan.num_tokens))
        if self.kv_evictor is not None:
            ctx = self.kv_evictor.attach(ctx)
        started = time.perf_counter()
        with forward_context(ctx), activation_quant(self.act_quant):  # a rank runs forward() alone
            if self.early_exit is not None and ctx.is_all_decode and not plan.pool_segments:
                hidden, exit_logits = self.early_exit.forward(plan.input_ids, plan.positions, ctx)  # [T, V] or None
                if exit_logits is not None:
                    return StepOutput(exit_logits[plan.logit_rows])
            else:
                hidden = self.model(plan.input_ids, plan.positions)  # [T, hidden]
        if self.spec_decoder is not None and ctx.is_all_decode:
            self.spec_decoder.record_target_step(time.perf_counter() - started)
        return StepOutput.of(self.model.compute_logits(hidden[plan.logit_rows]), hidden, plan)

    def context_for(self, plan: StepPlan) -> ForwardContext:
        """The forward context of a plan over this runner's cache, with the runtime attention patterns (a window
        may take positions past the rotary table: it grows first)."""
        if self.streams:
            self.model.rotary_emb.ensure(max(plan.seq_lens))
        mask = plan.expert_mask(self.config.moe.num_experts) if plan.expert_subsets else None
        routing = ExpertRouting(self.routing_policy, mask)
        return build_forward_context(
            plan.query_lens, plan.seq_lens, plan.block_ids, self.kv_cache, self.patterns, self._sink_rotary, routing
        )

    def _sink_rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rotary_emb(positions, self.model_dtype)

    def _sample(
        self,
        so: SchedulerOutput,
        sample_rows: list[int],
        logits: torch.Tensor,
        sampled: list[list[int]],
        logprobs: list[list[dict[int, float]] | None],
        mask: Future[GrammarMask] | None = None,
        errors: list[str | None] | None = None,
    ) -> None:
        """Fill `sampled` and `logprobs` for the sampling requests from their logit rows: one token each, or,
        in a step that verifies drafts, the accepted drafts plus one token each. Constrained requests sample under
        their grammar's `mask`, then add the tokens it forces (or their `errors` entry says why the grammar failed)."""
        sample_reqs = [so.scheduled_requests[i] for i in sample_rows]
        drafts = [so.spec_token_ids[i] if so.spec_token_ids else [] for i in sample_rows]
        rows_per_req = [len(d) + 1 for d in drafts]
        row_reqs = [r for r, n in zip(sample_reqs, rows_per_req) for _ in range(n)]
        metadata = SamplingMetadata.from_requests(
            row_reqs, self.config.vocab_size, self.device, self.config.eos_token_ids
        )
        if mask is not None:
            grammar = mask.result()  # the forward ran meanwhile
            metadata.grammar_rows, metadata.grammar_banned = grammar.rows, grammar.banned
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
        if mask is not None:
            advance = self.structured_output.advance(sample_reqs, token_ids, [bool(d) for d in drafts])
            for j, row in enumerate(sample_rows):
                errors[row] = advance.errors[j]
                if advance.num_forced[j] and logprobs[row] is not None:
                    # forced tokens ran no forward of their own: logprob 0, the one continuation the grammar allows
                    logprobs[row] += [{t: 0.0} for t in token_ids[j][-advance.num_forced[j] :]]

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
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

    def move_blocks(self, plan: StepPlan) -> None:
        """Before the forward writes: preempted requests' private blocks out to host memory and swapped ones back
        (every cache, scales too), then the copy-on-write copies (which may reuse a block just swapped out). On a
        parallel engine each rank moves its own slice: rank 0 has the largest blocks, so its host pool, which the
        scheduler's host block ids count, is the smallest."""
        if plan.blocks_to_swap_out or plan.blocks_to_swap_in:
            self.host_kv_pool.swap(plan.blocks_to_swap_out, plan.blocks_to_swap_in)
        self.copy_blocks(plan.blocks_to_copy)


def _pooled_per_request(
    num_requests: int, pool_requests: list[int], pooled: torch.Tensor | None
) -> list[torch.Tensor | None]:
    """Per request of a part, its pooled row [hidden] float32 CPU this step, or None."""
    out: list[torch.Tensor | None] = [None] * num_requests
    if pooled is not None:
        for row, idx in zip(pooled.cpu(), pool_requests, strict=True):
            out[idx] = row
    return out


def _prompt_logprobs(
    requests: list[Request], rows: list[PromptRows | None], logits: torch.Tensor
) -> list[tuple[list[dict[int, float] | None] | None, torch.Tensor | None]]:
    """Per request, its prompt logprob entries due this step, and with full_prompt_logprobs the whole log-softmax
    behind them ([n, V] float32 on CPU, one row per non-None entry); (None, None) when nothing is due. `logits`
    [sum of rows, V] holds the requests' prompt rows in order (StepPlan.logit_rows after the sample rows)."""
    out = []
    first_row = 0
    for req, due in zip(requests, rows):
        if due is None:
            out.append((None, None))
            continue
        k = req.sampling_params.prompt_logprobs
        entries: list[dict[int, float] | None] = [None] if due.with_first else []
        full = None
        if due.num_rows:
            all_logprobs = torch.log_softmax(logits[first_row : first_row + due.num_rows].float(), dim=-1)  # [Np, V]
            first_row += due.num_rows
            targets = torch.tensor(req.prompt_token_ids[due.first_entry : due.last_entry + 1], device=logits.device)
            entries.extend(logprobs_to_dicts(gather_logprobs(all_logprobs, targets, k), [k] * len(targets)))
            if req.sampling_params.full_prompt_logprobs:
                full = all_logprobs.cpu()
        out.append((entries or None, full))
    return out
