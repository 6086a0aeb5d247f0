"""The tokenizer a GGUF file describes: its `tokenizer.ggml.*` and `tokenizer.chat_template` keys, each per-token array
checked against the token list, as the GGUFTokenizerMetadata the tokenizer is built from (loading/gguf_tokenizer.py)."""

from __future__ import annotations

from leanlm.formats.gguf.config import field, required
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_file import GGUFFile
from leanlm.loading.gguf_tokenizer import GGUFTokenizerMetadata


def gguf_tokenizer_metadata(reader: GGUFFile) -> GGUFTokenizerMetadata:
    """Collect the `tokenizer.*` keys the Tokenizer is built from."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = field(reader, "tokenizer.ggml.scores") or []
    _check_per_token("tokenizer.ggml.token_type", types, len(tokens))
    if scores:
        _check_per_token("tokenizer.ggml.scores", scores, len(tokens))
    model = str(required(reader, "tokenizer.ggml.model"))
    is_spm = model == "llama"

    def optional_id(key: str) -> int | None:
        value = field(reader, f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return GGUFTokenizerMetadata(
        model=model,
        pre=str(field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in types),
        scores=tuple(float(s) for s in scores),
        merges=tuple(field(reader, "tokenizer.ggml.merges") or ()),
        bos_token_id=optional_id("bos_token_id"),
        eos_token_id=optional_id("eos_token_id"),
        unk_token_id=optional_id("unknown_token_id"),
        pad_token_id=optional_id("padding_token_id"),
        add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", is_spm)),
        add_eos_token=bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(field(reader, "tokenizer.ggml.add_space_prefix", is_spm)),
        chat_template=field(reader, "tokenizer.chat_template"),
    )


def _check_per_token(key: str, values: object, num_tokens: int) -> None:
    """A per-token array must have one entry per token: one of another length would pair tokens with the wrong type
    or score, silently."""
    if not isinstance(values, list) or len(values) != num_tokens:
        got = f"{len(values)} entries" if isinstance(values, list) else f"a {type(values).__name__}"
        raise ModelLoadError(
            f"GGUF metadata {key} has {got} but tokenizer.ggml.tokens has {num_tokens}; it needs one per token: "
            "the file is damaged or was written by a broken converter, re-download or re-convert it"
        )
