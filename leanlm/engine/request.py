"""Request: one sequence's state in the engine. The scheduler's single rule reads two counts from it:
`num_tokens` (prompt + generated) and `num_computed_tokens` (how many of those have KV in the cache)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from leanlm.lora_request import LoRARequest
from leanlm.pooling_params import PoolingParams
from leanlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were freed; recomputes on resume
    SWAPPED = "swapped"  # preempted with its private KV blocks in host memory; swapped back in to resume
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"  # cancelled by the user, or failed on its own
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason ('stop', 'length', 'abort', 'error'), None while unfinished."""
        return self.value if self.is_finished else None


class Request:
    """Mutable per-request state. Token lists only grow; `num_computed_tokens` may drop to 0 on preemption."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        device: torch.device | str = "cpu",
        keeps_kv: bool = False,
        seed_offset: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.lora_request = lora_request  # the adapter its tokens run with; None: the base model
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output, in order
        # Tokens whose KV is in the cache. Written by the Scheduler alone (admission, update, preemption, eviction
        # of held KV, forks: Scheduler.fork_request takes the count); everything else only reads it.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache when first scheduled
        # Computed tokens whose KV a KV budget evicted (engine/kv_budget.py): their positions stay, their slots are
        # reused. Written by the KVCacheManager alone (evict_over_budget; 0 again when it frees the request's blocks).
        self.num_evicted_tokens = 0
        self.num_preemptions = 0  # preemptions that dropped its KV (recompute)
        self.num_swaps = 0  # preemptions that swapped its KV out to host memory (kept)
        # Speculative decoding: draft tokens for the next step (they follow all_token_ids, unverified), and
        # how many drafts were verified / accepted so far.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None  # why it failed, when status is FINISHED_ERROR
        # Structured output: the grammar matcher, in the state after every output token (engine/structured_output.py);
        # set by the engine when the request is added, None for a free request.
        self.grammar: LLMatcher | None = None
        # Once finished by a stop or length condition, keep the KV blocks for forks (beam search) until
        # Scheduler.release_kv; aborted and failed requests free them anyway.
        self.keeps_kv = keeps_kv
        # Logprobs: one dict per generated token / per prompt position (None at position 0).
        self.output_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] = []
        # With full_prompt_logprobs: [n, V] float32 CPU chunks, rows aligned with prompt_logprobs[1:].
        self.prompt_logprobs_full: list[torch.Tensor] = []
        # Seeded requests own a generator so their samples do not depend on what else is in the batch. The n
        # completions of one prompt share one SamplingParams (its lists can be long); completion i draws from
        # seed + i (`seed_offset`), so seeded siblings differ but stay reproducible.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator(device=device)
            # Modulo 2**64: torch seeds are uint64 (a negative seed is its two's complement), and seed + i must
            # not overflow at the top of the range.
            self.generator.manual_seed((sampling_params.seed + seed_offset) % 2**64)
        # Timing, filled by the engine (time.monotonic()).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        # An embedding request (pooling_params set) computes its prompt and samples nothing: its chunks' pooled
        # hidden states accumulate in pooled_sum [hidden] float32 (mean: the sum of every prompt row; last: the
        # final row), and `embedding` [hidden] float32 CPU is set when the prompt is done.
        self.pooling_params = pooling_params
        self.pooled_sum: torch.Tensor | None = None
        self.embedding: torch.Tensor | None = None

    @property
    def is_embedding(self) -> bool:
        return self.pooling_params is not None

    @property
    def needs_every_prompt_token(self) -> bool:
        """Every prompt position must be computed here (prompt logprobs, mean pooling): no prefix-cache hits."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (pooling is not None and pooling.needs_every_token)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prefix_salt(self) -> int | None:
        """What its first KV block's prefix-cache hash chains from: the adapter (its KV differs from the base model's
        and every other adapter's for the same tokens); None for the base model."""
        lora = self.lora_request
        return None if lora is None else hash(("lora", lora.name, lora.path, lora.scale))

    @property
    def num_kv_tokens(self) -> int:
        """KV slots the request's computed tokens occupy: all of them, less those a KV budget evicted."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill_done(self) -> bool:
        """True once every prompt token has KV; a chunk that ends here yields a sampled token."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    def draft_room(self, max_model_len: int | None, num_new_tokens: int = 0) -> int:
        """Draft tokens that could still be kept after `num_new_tokens` more are appended: an accepted draft
        plus the token sampled after it must fit max_tokens and the context."""
        room = self.sampling_params.max_tokens - self.num_output_tokens - num_new_tokens - 1
        if max_model_len is not None:
            room = min(room, max_model_len - self.num_tokens - num_new_tokens - 1)
        return room

    def add_prompt_logprobs(self, entries: list[dict[int, float] | None] | None, full: torch.Tensor | None) -> None:
        """Record a chunk's prompt logprob entries (the runner scores only those not recorded yet: a preempted request
        recomputes its prompt) and, with full_prompt_logprobs, the same rows' whole log-softmax [n, V]."""
        if entries:
            self.prompt_logprobs.extend(entries)
        if full is not None:
            self.prompt_logprobs_full.append(full)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
