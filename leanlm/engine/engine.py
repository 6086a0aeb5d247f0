"""LLMEngine: one loop of schedule -> execute -> update over a paged KV cache (continuous batching).

Requests enter through `add_request` (validated there, so a bad one never reaches a batch); `step()` runs one
batch and returns the RequestOutputs that changed.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from leanlm.config import EngineConfig
from leanlm.config.long_context import STREAMING_CONTEXT
from leanlm.engine.block_pool import BlockPool
from leanlm.engine.early_exit import EarlyExitStats
from leanlm.engine.executor import IsolatingExecutor
from leanlm.engine.grammar import GrammarCompiler
from leanlm.engine.kv_budget import KVBudget
from leanlm.engine.kv_cache import KVCacheManager, KVRetention
from leanlm.engine.layout import EngineLayout
from leanlm.engine.lora_manager import LoRAManager
from leanlm.engine.model_runner import ModelRunner
from leanlm.engine.output_processor import OutputProcessor
from leanlm.engine.outputs import RequestOutput, SchedulerStats
from leanlm.engine.preemption import PreemptionCosts, Swapper
from leanlm.engine.request import Request
from leanlm.engine.scheduler import Scheduler
from leanlm.engine.spec_decode import SpecStats
from leanlm.engine.step_plan import StepOutput, StepPlan
from leanlm.engine.swap_space import SwapSpace
from leanlm.engine.threads import ThreadSizer
from leanlm.loading.tokenizer import Tokenizer
from leanlm.lora_request import LoRARequest
from leanlm.model.attention_pattern import kv_window
from leanlm.model.llama import LlamaForCausalLM
from leanlm.model.moe import MoESizes, MoEStats, moe_stats
from leanlm.model.offload import OffloadPlan
from leanlm.pooling_params import PoolingParams
from leanlm.sampling_params import RequestOutputKind, SamplingParams

# The sampling settings an embedding request carries (it samples nothing): one output, when it finishes.
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for metrics, logs and benchmarks."""

    scheduler: SchedulerStats
    num_kv_blocks: int
    num_free_kv_blocks: int  # free or evictable (held only by the prefix cache)
    num_running_tokens: int  # tokens with KV across running requests
    num_running_slots: int  # KV slots their blocks hold (block_size per block): running_tokens / slots = KV use
    spec_decode: SpecStats | None  # totals of speculative decoding; None when it is off
    early_exit: EarlyExitStats | None = None  # totals of CALM's early exit; None when it is off
    moe: MoEStats | None = None  # expert load, dropped tokens and expert bytes read; None for a dense model


class LLMEngine:
    """The surface everything outside engine/ uses: requests in, outputs out, stats; the scheduler, model
    runner and output processor behind it are internals."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        engine_config: EngineConfig,
        device: torch.device,
        model_dtype: torch.dtype,  # compute dtype; the KV cache stores it unless engine_config.kv_cache_dtype is 8-bit
        draft_model: LlamaForCausalLM | None = None,  # speculative 'draft:MODEL': the loaded draft
        offload_plan: OffloadPlan | None = None,  # the layers LLM offloaded (--max-weight-memory); None: all resident
    ) -> None:
        self.model_config = model.config
        self.model_dtype = model_dtype
        self.offload_plan = offload_plan
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.device = device
        context = self.model_config.max_position_embeddings
        self.max_model_len = min(engine_config.max_model_len or context, context)
        if engine_config.long_context.streams:  # a window bounds every query: neither context length limits it
            self.max_model_len = STREAMING_CONTEXT
        self.model_runner = ModelRunner(model, engine_config, device, model_dtype, draft_model, self.max_model_len)
        self._moe_sizes = MoESizes.of(model)  # weight bytes the MoE counters are read against (None: dense)
        pool = BlockPool(self.model_runner.num_blocks, enable_prefix_caching=engine_config.enable_prefix_caching)
        self.kv_budget = KVBudget.of(engine_config.long_context, engine_config.block_size)
        self.kv_cache_manager = KVCacheManager(
            pool, engine_config.block_size, self.kv_budget, retention=self._retention()
        )
        self.output_processor = OutputProcessor(tokenizer)
        eos_ids = tuple(dict.fromkeys(self.model_config.eos_token_ids + tokenizer.eos_token_ids))
        self.eos_token_ids = eos_ids
        # structured output: compiles each request's format (cached by spec) against this tokenizer, on first use
        self.grammar_compiler = GrammarCompiler(tokenizer, self.model_config.vocab_size, eos_ids)
        self.scheduler = Scheduler(
            engine_config,
            self.kv_cache_manager,
            self.max_model_len,
            eos_ids,
            stop_checker=self.output_processor.check_stop,
            swapper=self._swapper(),
        )
        # a parallel engine's driver gave each rank its share of the cores before building this engine
        threads = ThreadSizer(engine_config.num_threads) if engine_config.world_size == 1 else None
        self.lora_manager = self._lora_manager(model)
        self.model_runner.lora = self.lora_manager
        self.executor = IsolatingExecutor(self.model_runner, self.scheduler, threads)
        self._ids = itertools.count()

    def _lora_manager(self, model: LlamaForCausalLM) -> LoRAManager | None:
        """The adapters' slots with enable_lora; their hooks go on the model's target linears."""
        cfg = self.engine_config
        if not cfg.enable_lora:
            return None

        def in_use() -> set[str]:
            return {r.lora_request.name for r in self.scheduler.running if r.lora_request is not None}

        return LoRAManager(model, cfg.max_loras, cfg.max_lora_rank, self.model_dtype, self.device, in_use)

    def _retention(self) -> KVRetention | None:
        """What KV a sequence keeps when every layer reads a bounded window (trained or asked for); None: all."""
        cfg = self.model_config
        bounded = kv_window(self.model_runner.patterns, cfg.layer_windows, cfg.num_hidden_layers)
        if bounded is None:
            return None
        return KVRetention(*bounded, max_step_tokens=self.engine_config.max_num_batched_tokens)

    def _swapper(self) -> Swapper | None:
        """Swap preemption over the runner's host pool, when the config allows it."""
        pool = self.model_runner.host_kv_pool
        if pool is None:
            return None
        per_block = pool.bytes_per_block(pool.device_caches)
        costs = PreemptionCosts.estimate(self.model_runner.model, per_block, self.device)
        mode = self.engine_config.preemption_mode
        return Swapper(mode, self.kv_cache_manager, SwapSpace(pool.num_blocks), costs)

    # -- requests -----------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """A text prompt is encoded with the tokenizer's defaults; a token list is checked against the vocab."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give some text or token ids")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt]
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})"
            )
        return None, token_ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty after tokenization; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but the context holds {self.max_model_len} "
                f"(prompt + at least one generated token); shorten the prompt"
            )
        if isinstance(params, PoolingParams):
            self._validate_pooling()
            params = EMBEDDING_SAMPLING
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (or PoolingParams to embed), got {type(params).__name__}")
        needed = self.kv_cache_manager.peak_blocks(len(prompt_token_ids) + 1)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"the prompt needs {needed} KV blocks but the cache has {self.num_kv_blocks} "
                f"({self.kv_capacity_tokens} tokens); shorten the prompt or give the engine more KV cache memory"
            )
        vocab_size = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if params.experts is not None:
            self._validate_experts(params.experts)
        if params.structured_outputs is not None:
            self.grammar_compiler.matcher(params.structured_outputs)  # ValueError when it does not compile (cached)

    def _validate_pooling(self) -> None:
        """Embeddings read the final hidden states of the whole model: refused where a step does not end there."""
        if self.model_runner.early_exit is not None:
            raise ValueError("embeddings are not available with early exit on; start the engine without early_exit")

    def prepare_lora(self, lora_request: LoRARequest | None) -> None:
        """Read and check a request's adapter before it is queued (AdapterError / ValueError say what is wrong)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest(name, path), got {type(lora_request).__name__}")
        if self.lora_manager is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        self.lora_manager.prepare(lora_request)

    def _validate_experts(self, experts: tuple[int, ...]) -> None:
        moe = self.model_config.moe
        if moe is None:
            raise ValueError("experts pins a request to experts of a mixture-of-experts model; this model is dense")
        if experts[-1] >= moe.num_experts or len(experts) < moe.top_k:
            raise ValueError(
                f"experts must name at least top-k = {moe.top_k} experts in [0, {moe.num_experts}), got {list(experts)}"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); n > 1 becomes n child requests. Returns the request id. With
        PoolingParams the request embeds its prompt (RequestOutput.embedding) and generates nothing.

        `prompt_text` names the text of a prompt given as token ids (it is reported back, not re-tokenized).
        `lora_request`: the adapter it runs with (read and checked here, before anything is queued); None: the base.
        """
        text, token_ids = self.tokenize_prompt(prompt)
        prompt_text = text if text is not None else prompt_text
        self.validate(token_ids, params)
        self.prepare_lora(lora_request)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.child_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            request = Request(
                request_id, token_ids, EMBEDDING_SAMPLING, device=self.device, pooling_params=params,
                lora_request=lora_request,
            )  # fmt: skip
            self.output_processor.add(request_id, prompt_text, [request])
            self.scheduler.add_request(request)
            return request_id
        # The children share `params` (n is the parent's; a child's own seed is seed + i, see Request): copies
        # would repeat its per-request lists n times.
        children = [
            Request(
                f"{request_id}#{i}" if params.n > 1 else request_id,
                token_ids,
                params,
                device=self.device,
                seed_offset=i,
                lora_request=lora_request,
            )
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            for child in children:  # each completion follows the format on its own (a copy of the cached matcher)
                child.grammar = self.grammar_compiler.matcher(params.structured_outputs)
        self.output_processor.add(request_id, prompt_text, children)
        if len(children) > 1 and params.prompt_logprobs is None and not self._is_budgeted(children[0]):
            # Parallel sampling: one prompt computation, its KV blocks shared copy-on-write by all n (not under a
            # KV budget, which evicts per sequence: each completion then computes the prompt itself).
            self.scheduler.add_sampling_group(children[0], children[1:])
        else:
            for child in children:
                self.scheduler.add_request(child)
        return request_id

    def _is_budgeted(self, request: Request) -> bool:
        return self.kv_budget is not None and self.kv_budget.applies_to(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (all its completions) and free its KV blocks; returns its final output."""
        children = self.output_processor.child_ids(request_id)
        aborted = [r for r in (self.scheduler.abort_request(cid) for cid in children) if r is not None]
        outputs = self.output_processor.make_outputs(aborted)
        self.output_processor.forget(request_id)
        return outputs[0] if outputs else None

    # -- the loop -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)
        return self.output_processor.make_outputs(self.scheduler.update(scheduler_output, runner_output))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- requests built by a collaborator (beam search) ----------------------------------------------

    def add_prepared_request(self, request: Request) -> None:
        """Queue a Request built elsewhere (beam search's beams). It bypasses the OutputProcessor: step() does
        not report it, and its caller reads the results off the request."""
        self.scheduler.add_request(request)

    def fork_request(self, parent: Request, child: Request, num_computed_tokens: int) -> None:
        """Start `child` on the KV `parent` holds for its first `num_computed_tokens` tokens, shared copy-on-write
        (parent running, or finished with keeps_kv and not yet released)."""
        self.scheduler.fork_request(parent, child, num_computed_tokens)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished keeps_kv request still holds; False when it holds none."""
        return self.scheduler.release_kv(request_id)

    def drop_request(self, request_id: str) -> None:
        """Abort a prepared request if it is still running and free any blocks it holds."""
        self.scheduler.abort_request(request_id)
        self.scheduler.release_kv(request_id)

    def unfinished_request_ids(self) -> list[str]:
        """Ids given to add_request whose outputs have not all finished."""
        return list(self.output_processor.parent_ids())

    def set_step_forward(
        self, forward: Callable[[ModelRunner, list[StepPlan]], list[StepOutput]], num_microbatches: int = 1
    ) -> None:
        """Run each step's forward through `forward(runner, plans)` (leanlm.parallel: the plans go to every rank
        first), with the step's requests split into `num_microbatches` plans (a pipeline's micro-batches)."""
        self.model_runner.step_forward = functools.partial(forward, self.model_runner)
        self.model_runner.num_microbatches = num_microbatches

    # -- what the engine holds ----------------------------------------------------------------------

    def moe_stats(self) -> MoEStats | None:
        """The MoE counters alone (read-only: safe to call from another thread while the engine steps)."""
        return moe_stats(self.model, self._moe_sizes)

    def stats(self, include_moe: bool = True) -> EngineStats:
        """`include_moe` False skips the MoE counters (a per-step snapshot need not walk every layer)."""
        running = self.scheduler.running
        kv = self.kv_cache_manager
        spec = self.model_runner.spec_decoder
        return EngineStats(
            scheduler=self.scheduler.stats(),
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            num_running_tokens=sum(r.num_computed_tokens for r in running),
            num_running_slots=sum(len(kv.get_block_ids(r.request_id)) for r in running) * self.engine_config.block_size,
            spec_decode=spec.stats() if spec is not None else None,
            early_exit=self.model_runner.early_exit.stats() if self.model_runner.early_exit is not None else None,
            moe=self.moe_stats() if include_moe else None,
        )

    def layout(self) -> EngineLayout:
        """What this engine runs on and how it is spread (the start-up line, /metrics)."""
        return EngineLayout.of(self, self.offload_plan)

    @property
    def model(self) -> LlamaForCausalLM:
        """The network this engine runs (its weights may be shared with other engines)."""
        return self.model_runner.model

    @property
    def num_kv_blocks(self) -> int:
        return self.model_runner.num_blocks

    @property
    def kv_capacity_tokens(self) -> int:
        return self.model_runner.num_blocks * self.engine_config.block_size

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """How K/V are stored (the model dtype, or an 8-bit dtype)."""
        return self.model_runner.kv_cache_dtype

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of every KV tensor the engine allocated (a draft model's cache included)."""
        return self.model_runner.kv_cache_bytes
