"""SpeculativeConfig (how speculative decoding drafts and verifies) and EarlyExitConfig (where CALM's per-token
early exit may leave the network): the two typed decoding options of EngineConfig, frozen and validated."""

from __future__ import annotations

from dataclasses import dataclass

EXIT_MEASURES = ("softmax", "gap", "saturation")  # CALM's confidence measures (leanlm.engine.early_exit)


@dataclass(frozen=True)
class EarlyExitConfig:
    """CALM (Schuster et al. 2022) at decode: after K layers a decode step measures its tokens' confidence at the
    exit there and, when every token of the step reaches the exit's threshold, takes their next tokens from that
    exit and skips the remaining layers, whose KV for these tokens it fills from the hidden state at K."""

    exits: tuple[tuple[int, float], ...]  # (layer count K, threshold), K increasing
    measure: str = "softmax"  # one of EXIT_MEASURES

    def __post_init__(self) -> None:
        layers = [k for k, _ in self.exits]
        if not layers or layers != sorted(set(layers)) or layers[0] < 1:
            raise ValueError(f"early exits need increasing layer counts >= 1, e.g. 24:0.9; got {self.exits}")
        if self.measure not in EXIT_MEASURES:
            raise ValueError(f"unknown confidence measure {self.measure!r}; use one of {', '.join(EXIT_MEASURES)}")

    @classmethod
    def parse(cls, spec: str, measure: str = "softmax") -> EarlyExitConfig:
        """'16:0.95,24:0.9' -> exits ((16, 0.95), (24, 0.9))."""
        try:
            exits = tuple((int(k), float(t)) for k, t in (part.split(":") for part in spec.split(",")))
        except ValueError:
            raise ValueError(
                f"--early-exit takes K:THRESHOLD pairs, e.g. 24:0.9 or 16:0.95,24:0.9; got {spec!r}"
            ) from None
        return cls(exits, measure)


SPECULATIVE_METHODS = ("ngram", "suffix", "draft", "self", "lookahead")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How speculative decoding proposes and how much it verifies (Leviathan et al. 2023, Chen et al. 2023).

    The number of draft tokens adapts to each request's acceptance rate: k maximizes expected tokens per unit
    of step cost, where one step costs 1 + verify_overhead (when k > 0) + draft_cost * k.
    """

    # ngram: prompt lookup (the latest earlier match of the context's tail); suffix: lookup that follows the copied
    # source and resumes it after an edit; draft: a smaller model with the same tokenizer; self: the target's own
    # first layers with its final norm and head; lookahead: Jacobi iteration plus an n-gram pool (no draft model)
    method: str
    draft_model: str | None = None  # draft: a bundled name, GGUF file or HF directory (a quantized copy works)
    num_draft_layers: int | None = None  # self: how many of the target's first layers draft
    num_speculative_tokens: int = 4  # most draft tokens per request and step (k)
    prompt_lookup_min: int = 1  # ngram, suffix: shortest tail n-gram that may match
    prompt_lookup_max: int = 4  # ngram, suffix: longest tail n-gram tried first
    adaptive: bool = True  # adapt k to each request's acceptance rate; False always proposes up to k
    max_batch_size: int = 8  # steps sampling more requests than this do not speculate: verification stops paying
    verify_overhead: float = 0.2  # a verifying step's extra cost over a plain decode step (relative)
    # each draft token's extra cost (proposing it and verifying its row), relative to a target step; None: 0.05
    # for n-gram drafts, and for a draft model its measured step time over the target's (before 3 of each are
    # measured: its weight bytes over the target's, as a decode step reads every weight)
    draft_cost: float | None = None
    probe_interval: int = 16  # steps a request waits at k = 0 before proposing again to re-measure acceptance

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {', '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model goes with method 'draft' (and only with it): use --speculative draft:MODEL")
        if (self.method == "self") != (self.num_draft_layers is not None):
            raise ValueError("a layer count goes with method 'self' (and only with it): use --speculative self:K")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ValueError(f"self-speculation needs at least 1 draft layer, got {self.num_draft_layers}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.verify_overhead < 0 or (self.draft_cost is not None and self.draft_cost < 0):
            raise ValueError("verify_overhead and draft_cost are relative costs and must be >= 0")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}")

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model that writes KV for them: the scheduler reserves lookahead slots."""
        return self.method in ("draft", "self")

    @classmethod
    def parse(cls, spec: str, num_speculative_tokens: int = 4, max_batch_size: int = 8) -> SpeculativeConfig:
        """From the CLI form: 'ngram', 'suffix', 'lookahead', 'draft:MODEL' or 'self:K'."""
        counts = {"num_speculative_tokens": num_speculative_tokens, "max_batch_size": max_batch_size}
        method, _, arg = spec.strip().partition(":")
        if method == "draft":
            if not arg:
                raise ValueError("--speculative draft needs a model: draft:MODEL (a name, GGUF file or directory)")
            return cls(method, draft_model=arg, **counts)
        if method == "self":
            if not arg.isdigit():
                raise ValueError(f"--speculative self needs a layer count: self:K, got {spec!r}")
            return cls(method, num_draft_layers=int(arg), **counts)
        if arg:
            raise ValueError(f"speculative method {method!r} takes no argument, got {spec!r}")
        return cls(method, **counts)
