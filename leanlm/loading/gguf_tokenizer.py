"""The tokenizer a GGUF file describes (GGUFTokenizerMetadata: its `tokenizer.ggml.*` values, read by
formats/gguf/tokenizer.py) built as a `tokenizers.Tokenizer`: byte-level BPE ("gpt2") from tokens + merges, with the
split its pre-tokenizer names; SentencePiece BPE ("llama") from tokens + scores + types."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from leanlm.loading.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The tokenizer a GGUF file describes, under llama.cpp's `tokenizer.ggml.*` keys."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE) are the ones we build
    pre: str  # tokenizer.ggml.pre: which pre-tokenizer split the merges were learned with
    tokens: tuple[str, ...]  # id -> token: gpt2's spelled in the byte-level alphabet, llama's with "▁" for a space
    # id -> llama.cpp type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    token_types: tuple[int, ...]
    scores: tuple[float, ...]  # id -> SentencePiece score (higher merges first); empty when the file has none
    merges: tuple[str, ...]  # "a b" pairs, best first (gpt2); SentencePiece files have none: scores rank merges
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool  # absent: True for "llama" (llama.cpp's and HF's default for SentencePiece), else False
    add_eos_token: bool
    # SentencePiece prepends "▁" to text (and to the text after each control or user-defined token, as llama.cpp
    # does); absent: True for "llama", llama.cpp's default. Byte-level BPE ignores it.
    add_space_prefix: bool
    chat_template: str | None


_UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 2, 3, 4, 5, 6  # llama.cpp token types (1 is normal)
# Types SentencePiece keeps out of its merge table (its "reserved" pieces): BPE never forms them from text.
_NOT_MERGED = (_UNKNOWN, _CONTROL, _UNUSED, _BYTE)
_SPM_SPACE = "\u2581"  # how SentencePiece spells a space inside its pieces

# Split regexes of the BPE families we know, keyed by `tokenizer.ggml.pre`. Each must be the split the
# merges were learned with, or ids drift on digits and whitespace runs.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
}
# Pre-tokenizers that isolate every digit first, then apply GPT-2's regex (llama.cpp's SMOLLM/STARCODER;
# SmolLM2's own tokenizer.json is Digits(individual) + ByteLevel).
_DIGIT_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_REGEXES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _DIGIT_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in ("gpt2", "default"):
        logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2's split (ids may differ from the reference)", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_gguf_tokenizer(meta: GGUFTokenizerMetadata) -> HFTokenizer:
    """The tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes, with BOS added when the file asks."""
    builder = _GGUF_BUILDERS.get(meta.model)
    if builder is None:
        raise ModelLoadError(
            f"GGUF tokenizer model {meta.model!r} is not supported; we build byte-level BPE ('gpt2') and "
            "SentencePiece BPE ('llama'): use a model whose tokenizer is one of these, or its HF directory"
        )
    tokenizer = builder(meta)
    if meta.add_bos_token and meta.bos_token_id is not None:
        bos = meta.tokens[meta.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, meta.bos_token_id)]
        )
    return tokenizer


def _byte_level_bpe(meta: GGUFTokenizerMetadata) -> HFTokenizer:
    """Byte-level BPE ("gpt2") from GGUF tokens + merges; control tokens become special added tokens."""
    alphabet = _bytes_to_unicode()
    in_alphabet = set(alphabet.values())
    # A token stored in raw form (e.g. a real space) is re-spelled in the byte alphabet so BPE can reach it.
    vocab = {
        tok if set(tok) <= in_alphabet else "".join(alphabet[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(meta.tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.merges]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.pre)
    tokenizer.decoder = decoders.ByteLevel()
    typed = list(zip(meta.tokens, meta.token_types))
    # A "control" token spelled outside the byte alphabet is a converter mislabel; adding it would grow the vocab.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in typed
            if kind == _CONTROL and set(t) <= in_alphabet
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in typed if kind == _USER_DEFINED and t in vocab]
    )
    return tokenizer


def _sentencepiece_bpe(meta: GGUFTokenizerMetadata) -> HFTokenizer:
    """SentencePiece BPE ("llama": Llama 2, Mistral, Gemma) from GGUF tokens + scores: BPE over the whole text with
    spaces spelled "▁", a character outside the vocabulary as its UTF-8 <0xXX> byte tokens.

    Control and user-defined tokens are matched whole before BPE, as llama.cpp does (SentencePiece matches its
    user-defined pieces whole too). The "▁" prefix goes on each stretch of text between them, as llama.cpp
    does; HF's Llama tokenizer puts it on the first stretch only, so ids can differ after a control token there.
    """
    if len(meta.scores) != len(meta.tokens):
        raise ModelLoadError(
            "GGUF SentencePiece tokenizer has no tokenizer.ggml.scores, so its merges cannot be recovered; "
            "re-convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    vocab = {token: idx for idx, token in enumerate(meta.tokens)}
    unk = meta.unk_token_id
    model = models.BPE(
        vocab=vocab,
        merges=_sentencepiece_merges(meta),
        unk_token=None if unk is None or unk >= len(meta.tokens) else meta.tokens[unk],
        fuse_unk=True,  # SentencePiece emits one <unk> for a run of unknown characters
        byte_fallback=True,
    )
    tokenizer = HFTokenizer(model)
    prefix = [normalizers.Prepend(_SPM_SPACE)] if meta.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", _SPM_SPACE)])
    # Fuse before Strip: Strip cuts each token it gets, and the prefix space is the text's, not each token's.
    strip = [decoders.Strip(" ", 1, 0)] if meta.add_space_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    typed = list(zip(meta.tokens, meta.token_types))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL and t]
    )
    # normalized=False: matched in the raw text, so Gemma's whitespace-run tokens (stored as real spaces by
    # llama.cpp's converter) take a run of spaces whole, longest first, as SentencePiece's user-defined pieces do.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED and t])
    return tokenizer


def _sentencepiece_merges(meta: GGUFTokenizerMetadata) -> list[tuple[str, str]]:
    """SentencePiece's merge order as the ranked pairs `models.BPE` takes, best first.

    SentencePiece BPE repeatedly joins the adjacent pair whose joined piece is in the vocabulary with the highest
    score (leftmost on a tie); a pair's rank is therefore its joined piece's score. Every split of a piece into two
    pieces is a pair; splits of one piece rank longest left part first (HF's GGUF converter does the same, and
    SentencePiece has no order among them); equal scores rank by id, the order training learned them in. Pieces
    SentencePiece reserves (control, unknown, unused, byte) are never joined into or from.

    One pass over the pieces in rank order, one dict lookup per split point: ~sum of piece lengths lookups.
    """
    tokens, scores = meta.tokens, meta.scores
    mergeable = {t for t, kind in zip(tokens, meta.token_types) if kind not in _NOT_MERGED}
    merges: list[tuple[str, str]] = []
    for idx in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        piece = tokens[idx]
        if len(piece) < 2 or piece not in mergeable:
            continue
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((left, right))
    return merges


# tokenizer.ggml.model -> the builder of that kind of tokenizer
_GGUF_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
