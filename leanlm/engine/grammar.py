"""GrammarCompiler: StructuredOutputsParams -> a llguidance LLMatcher over this engine's tokenizer. One LLTokenizer per
engine; compiled matchers are cached by spec (a request gets a copy of the cached one, in its start state)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from leanlm.loading.tokenizer import Tokenizer
from leanlm.structured_outputs import StructuredOutputsParams

# Distinct specs whose compiled matcher is kept: a server that sees the same few schemas compiles each once.
MAX_CACHED_GRAMMARS = 256


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked: LLMatcher reports what is wrong with it)."""
    matcher = llguidance.LLMatcher
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else '{"type": "object"}'
        # Any whitespace unless disabled; a schema's own "x-guidance" options may narrow it, never widen a disable.
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        where = "overrides" if spec.disable_any_whitespace else "defaults"
        try:
            return matcher.grammar_from_json_schema(schema, **{where: options})
        except ValueError as exc:
            raise ValueError(f"structured_outputs json is not a valid JSON schema: {exc}") from None
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        lark = any_to_lark(spec.grammar)  # Lark as it is; GBNF (`root ::= ...`) converted
    except Exception as exc:  # the converter raises its own error types on malformed GBNF
        raise ValueError(f"structured_outputs grammar is neither Lark nor valid GBNF: {exc}") from None
    return matcher.grammar_from_lark(lark)


class GrammarCompiler:
    """Thread-safe (the server prepares requests off the engine's thread). The LLTokenizer is built on first use:
    an engine that never sees a constrained request never pays for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        # The model's logit rows may be wider than the tokenizer (SmolLM2: both 49,152; many models pad to a multiple
        # of 64): ids past the tokenizer have no bytes and are never allowed. Masks are vocab_size wide.
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < tokenizer.vocab_size]
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                if not self.eos_token_ids:
                    raise ValueError("structured output needs an EOS token in the tokenizer; this one has none")
                n_vocab = max(self.vocab_size, self.tokenizer.vocab_size)
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request in the start state. ValueError when the spec does not compile."""
        key = _cache_key(spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        tokenizer = self.ll_tokenizer
        template = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)  # drops the GIL while compiling
        if template.is_error():
            raise ValueError(f"structured_outputs {spec.kind} does not compile: {template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template.deep_copy()

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def _cache_key(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """What the compiled grammar depends on: the spec less jump_forward (a decoding option, not part of the format)."""
    return dataclasses.replace(spec, jump_forward=True)
