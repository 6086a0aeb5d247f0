"""SamplingParams: what one request asks of the sampler and the stop conditions (vLLM-compatible names)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from leanlm.structured_outputs import StructuredOutputsParams

# Temperatures below this sample greedily (dividing logits by ~0 would overflow); vLLM uses the same cut.
GREEDY_TEMPERATURE_EPS = 1e-5
# The repetition penalty divides positive logits and multiplies negative ones in float32: far from 1 it makes a
# seen token's logit overflow to inf or vanish to 0 (1e-300 rounds to a zero penalty: the same token forever).
# HF and vLLM users set 1.0-2.0; [1/100, 100] keeps every logit finite and every row distinct.
MAX_REPETITION_PENALTY = 100.0
# Beam search scores a hypothesis cum_logprob / length ** length_penalty: past this magnitude the power overflows
# a double on long outputs (HF's typical values are 0.6-2).
MAX_LENGTH_PENALTY = 10.0
# Seeds are what torch.Generator.manual_seed takes: 64-bit integers, signed or unsigned.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: anything smaller rounds toward 0


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far: each output copies the whole text, ids and logprobs
    DELTA = "delta"  # only what is new since the previous output (a stream's cost per step is its increment)
    FINAL_ONLY = "final_only"  # no output until the request finishes, then the whole result


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. Validated on construction; messages say how to fix the value."""

    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None, 0 or -1 keep all (vLLM accepts -1)
    min_p: float = 0.0  # drop tokens whose probability < min_p * max probability
    presence_penalty: float = 0.0  # OpenAI: subtract once if the token appeared in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL: divide positive / multiply negative logits of seen tokens
    seed: int | None = None  # makes this request's samples reproducible, whatever else is batched with it
    max_tokens: int = 16  # most tokens to generate
    min_tokens: int = 0  # EOS / stop token ids are masked until this many tokens exist
    stop: tuple[str, ...] = ()  # strings that end generation; not included in the text
    stop_token_ids: tuple[int, ...] = ()  # token ids that end generation, besides EOS
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt position (plus the actual token)
    # Also return the whole log-softmax of every scored prompt position, RequestOutput.prompt_logprobs_full
    # [P-1, V] float32 on CPU (KL divergence needs full distributions). V floats per token: score in chunks.
    full_prompt_logprobs: bool = False
    skip_special_tokens: bool = True
    # OpenAI logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before sampling; a
    # mapping is accepted and stored sorted (a tuple keeps the dataclass hashable).
    logit_bias: tuple[tuple[int, float], ...] = ()
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each streamed output holds
    # static task routing (Kudugunta et al. 2021): a mixture-of-experts model routes this request's tokens only among
    # these experts, in every MoE layer, so only their weights are read for it; None: all experts
    experts: tuple[int, ...] | None = None
    # structured output: the format (JSON schema, regex, choice, grammar) every sampled token is masked to; None: free
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.experts is not None:
            experts = tuple(sorted({int(e) for e in self.experts}))
            if not experts or experts[0] < 0:
                raise ValueError(f"experts pins a non-empty set of expert indices >= 0, got {self.experts!r}")
            object.__setattr__(self, "experts", experts)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.top_k in (0, -1):
            object.__setattr__(self, "top_k", None)
        self._validate()

    def _validate(self) -> None:
        # NaN passes every range check below (all its comparisons are false) and an infinite penalty turns a zero
        # logit into NaN (0 * inf), which poisons the whole row's softmax: refuse both before any range check.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            # The sampler holds these as float32: a finite double beyond its range becomes inf or 0 there.
            if value != 0 and not _FLOAT32_TINY <= abs(value) <= _FLOAT32_MAX:
                raise ValueError(f"{name} must be 0 or have a magnitude in [1.2e-38, 3.4e38] (float32), got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < -1):
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 disables it; > 1 discourages repeats), got {self.repetition_penalty}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}; "
                f"lower min_tokens or raise max_tokens"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # Token ids are indices into the vocabulary: the engine checks the upper bound (it knows the vocabulary).
        bad_ids = [t for t in self.stop_token_ids if t < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {bad_ids[:5]}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100 <= bias <= 100:  # NaN fails the range check too
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token_id}: {bias}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )
        if self.full_prompt_logprobs and self.prompt_logprobs is None:
            raise ValueError("full_prompt_logprobs needs prompt_logprobs set too (0 is enough)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


# The float-valued fields, each checked for NaN and infinity before its range.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
