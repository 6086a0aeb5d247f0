"""Tokenizer: a `tokenizers.Tokenizer` built from GGUF metadata (gguf_tokenizer.py) or an HF directory, plus the
chat template.

Also `IncrementalDetokenizer`, which streams text token by token with the prefix/read-offset technique
(decode a small window, never emit half a UTF-8 character).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from leanlm.loading.chat_template import MAX_RENDER_CHARS, render_chat_template
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_tokenizer import GGUFTokenizerMetadata, build_gguf_tokenizer

# Tokens that end a chat turn in the families we support; added to eos_token_ids when present. Gemma's chat template
# closes every turn with "<end_of_turn>\n": an instruction-tuned Gemma ends its reply there, not at <eos>.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")

# Texts a tokenizer.json must encode before we accept it: a long run of each kind of character, ended by one of
# another kind, which is where a backtracking pre-tokenizer regex ("(a+)+$") exhausts the regex engine's retry
# limit and the Rust tokenizer panics. A run of 48 puts exponential patterns far past the limit.
_PROBE_RUN = 48
_PROBE_CHARS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    " \t\n\r!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\u00e9\u00df\u4e2d\u0416\U0001f600"
)
_PROBES = tuple(c * _PROBE_RUN + ("!" if c.isalnum() else "a") for c in _PROBE_CHARS)


class TokenizerError(ValueError):
    """The tokenizer could not encode a text: its Rust backend panicked (a pre-tokenizer regex that backtracks
    past the regex engine's limit). A ValueError, so the server answers 400 and the CLI prints one line."""


def _is_rust_panic(exc: BaseException) -> bool:
    """pyo3 turns a Rust panic into `pyo3_runtime.PanicException`, a BaseException that no module exports (so
    `except Exception` misses it); it is known by its module and name."""
    return type(exc).__module__ == "pyo3_runtime" and type(exc).__name__ == "PanicException"


def _encode_ids(backend: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """backend.encode(...).ids, with a panic of the backend as a TokenizerError (the backend stays usable)."""
    try:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    except BaseException as e:
        if not _is_rust_panic(e):
            raise
        panic = " ".join(str(e).split())[:200]  # one line: the CLI prints it as its error
        raise TokenizerError(
            f"the tokenizer failed on this text ({panic}); its tokenizer.json has a pre-tokenizer regex that "
            "backtracks without bound: send other text, or fix or replace the model's tokenizer.json"
        ) from None


class Tokenizer:
    """Text <-> ids for one model, with its special tokens and chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend  # the tokenizers.Tokenizer doing the work
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token  # informational: the post-processor already adds it
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        end_of_turn = [self.backend.token_to_id(t) for t in END_OF_TURN_TOKENS]
        ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + [i for i in end_of_turn if i is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))  # every id that ends generation
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: tuple[int, ...] = tuple(sorted(i for i, tok in added.items() if tok.special))
        # Each control token's text encoded as ordinary text (its characters, not its id): what a chat message
        # that contains it is encoded as by default (chat_encoding). Built here, before any thread shares the
        # backend, because the switch that splits special tokens is the backend's global state.
        # Longest first, and so is the pattern that finds them: no token's prefix matches in its place.
        self.control_token_text_ids: dict[str, tuple[int, ...]] = {}
        backend.encode_special_tokens = True
        try:
            controls = {tok.content for tok in added.values() if tok.special and tok.content}
            for token in sorted(controls, key=lambda t: (-len(t), t)):
                self.control_token_text_ids[token] = tuple(_encode_ids(backend, token, add_special_tokens=False))
        finally:
            backend.encode_special_tokens = False
        tokens = self.control_token_text_ids
        self.control_token_pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @classmethod
    def from_gguf_metadata(cls, meta: GGUFTokenizerMetadata) -> Tokenizer:
        def token(token_id: int | None) -> str | None:
            return None if token_id is None or token_id >= len(meta.tokens) else meta.tokens[token_id]

        return cls(
            build_gguf_tokenizer(meta),
            token(meta.bos_token_id),
            token(meta.eos_token_id),
            meta.chat_template,
            add_bos_token=meta.add_bos_token,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`) from an HF directory."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(
                f"{path} has no tokenizer.json; save the tokenizer with the model "
                "(Tokenizer.save) or copy it from the original model directory"
            )
        try:
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
            cfg = (
                json.loads((path / "tokenizer_config.json").read_text())
                if (path / "tokenizer_config.json").is_file()
                else {}
            )
        except Exception as e:
            raise ModelLoadError(f"tokenizer files in {path} are corrupt ({e}); re-download the model") from e
        _refuse_panicking(backend, path / "tokenizer.json")
        template = _pick_template(cfg.get("chat_template"))
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(
            backend,
            _token_content(cfg.get("bos_token")),
            _token_content(cfg.get("eos_token")),
            template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` into directory `path` (readable by `from_dir`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        cfg = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (a byte-level BPE's: in bytes). Each token covers at most this
        many characters of text, so a text longer than n x this has more than n tokens."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode_ids(self.backend, text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        max_chars: int = MAX_RENDER_CHARS,
        **variables: Any,
    ) -> str | list[int]:
        """Render the chat prompt (like HF); `tokenize=True` returns ids without extra special tokens. A render
        longer than max_chars raises ChatTemplateError."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead of chat messages")
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            max_chars=max_chars,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _refuse_panicking(backend: HFTokenizer, source: Path) -> None:
    """ModelLoadError when a probe text makes the tokenizer panic: refused at load, not on a user's prompt."""
    for text in _PROBES:
        try:
            _encode_ids(backend, text, add_special_tokens=False)
        except TokenizerError:
            raise ModelLoadError(
                f"{source} cannot encode a run of {text[0]!r} (its Rust tokenizer panics: a pre-tokenizer regex that "
                "backtracks without bound); fix its pre_tokenizer pattern or use the original model's tokenizer.json"
            ) from None


def _token_content(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _pick_template(template: str | list | None) -> str | None:
    """tokenizer_config.json holds one template or a list of {name, template}; we use 'default'."""
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template


class IncrementalDetokenizer:
    """Turns a growing id sequence into text deltas, decoding only a short window per step.

    Invariant: ids[prefix_offset:read_offset] decode to text already emitted and end on a character
    boundary; text that ends in U+FFFD (an incomplete UTF-8 sequence) is held back until completed, but for at
    most _MAX_HELD tokens: a character takes at most 4 bytes, so a longer held run is invalid UTF-8 (forced byte
    tokens, say) and is emitted as it decodes, with U+FFFD replacements, as HF and vLLM do. Without that bound
    the window, and each step's decode, grew with every such token.
    """

    _CONTEXT = 5  # prompt tokens kept as left context, so the first delta gets spacing right
    _MAX_HELD = 8  # tokens held back before their text is emitted anyway

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids)
        self.prefix_offset = max(len(self.ids) - self._CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append ids; return only the newly completed text (possibly '')."""
        self.ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        is_incomplete = len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")
        if is_incomplete and len(self.ids) - self.read_offset < self._MAX_HELD:
            return ""
        return self._emit(prefix_text, full_text)

    def flush(self) -> str:
        """At the end of the sequence: the held-back tail as it decodes (an incomplete UTF-8 sequence becomes
        U+FFFD), so the whole text equals decoding all the ids, as HF's decode gives it."""
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        return self._emit(prefix_text, decode(self.ids[self.prefix_offset :], self.skip_special_tokens))

    def _emit(self, prefix_text: str, full_text: str) -> str:
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
