"""SentencePiece BPE tokenizers (GGUF `tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Gemma) from GGUF metadata.

Fast tier: a tiny vocabulary built in code, also written as a tokenizer-only GGUF for the metadata reader and for
HF's GGUF converter. Real-model tier: Gemma 3 270M's 262,144-token vocabulary against HF's GGUF tokenizer.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from leanlm.formats.gguf import open_gguf
from leanlm.formats.gguf.tokenizer import gguf_tokenizer_metadata
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.gguf_tokenizer import GGUFTokenizerMetadata, build_gguf_tokenizer
from leanlm.loading.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp token types
SPACE = "\u2581"

SPECIALS = [
    ("<unk>", UNKNOWN),
    ("<s>", CONTROL),
    ("</s>", CONTROL),
    ("<start_of_turn>", CONTROL),
    ("<end_of_turn>", CONTROL),
    ("<br>", USER_DEFINED),
    ("  ", USER_DEFINED),  # a whitespace run, stored with real spaces as llama.cpp's converter writes Gemma's
]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Normal pieces best first, as SentencePiece lists them: merged pieces by score, then the single characters.
PIECES = [
    *(SPACE + "t", "he", "ll", SPACE + "the", "llo", SPACE + "he", SPACE + "hello"),
    *("or", SPACE + "w", SPACE + "wor", "ld", SPACE + "world", "ab", "bc", "12"),
    *(SPACE + "abcdehilortw123"),
]


def spm_meta(
    add_space_prefix: bool = True,
    add_bos_token: bool = False,
    with_bytes: bool = True,
    score_of: dict[str, float] | None = None,
) -> GGUFTokenizerMetadata:
    """The tiny vocabulary: specials, byte tokens, normal pieces scored -rank (`score_of` overrides a piece's)."""
    typed = SPECIALS + [(b, BYTE) for b in BYTES if with_bytes] + [(p, NORMAL) for p in PIECES]
    tokens = [t for t, _ in typed]
    rank = {p: -float(i) for i, p in enumerate(PIECES)} | (score_of or {})
    return GGUFTokenizerMetadata(
        model="llama",
        pre="default",
        tokens=tuple(tokens),
        token_types=tuple(k for _, k in typed),
        scores=tuple(rank.get(t, -1000.0 if k != BYTE else 0.0) for t, k in typed),
        merges=(),
        bos_token_id=tokens.index("<s>"),
        eos_token_id=tokens.index("</s>"),
        unk_token_id=tokens.index("<unk>"),
        pad_token_id=None,
        add_bos_token=add_bos_token,
        add_eos_token=False,
        add_space_prefix=add_space_prefix,
        chat_template=None,
    )


def pieces(meta: GGUFTokenizerMetadata, text: str) -> list[str]:
    backend = build_gguf_tokenizer(meta)
    return [backend.id_to_token(i) for i in backend.encode(text, add_special_tokens=False).ids]


# ---------------------------------------------------------------------------------------------- tiny vocabulary


def test_encode_merges_by_score_with_a_space_prefix():
    assert pieces(spm_meta(), "hello world") == [SPACE + "hello", SPACE + "world"]
    assert pieces(spm_meta(), "the") == [SPACE + "the"]


def test_without_a_space_prefix_only_spaces_become_the_marker():
    """Gemma's files say add_space_prefix=False: the text's first word has no "▁" (and its merges differ). HF's GGUF
    converter ignores the flag for a "llama" vocabulary outside Gemma and Phi-3 (it never reaches LlamaTokenizer,
    which then prefixes): for this vocabulary it gives "▁hello" here."""
    meta = spm_meta(add_space_prefix=False)
    assert pieces(meta, "hello world") == ["he", "llo", SPACE + "world"]
    assert pieces(meta, " hello") == [SPACE + "hello"]


ROUND_TRIP_TEXTS = ["hello world", " hello", "hello ", " the world ", "a\tb\nc", "héllo 12 🤖", ""]


@pytest.mark.parametrize("add_space_prefix", [True, False])
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_round_trips(add_space_prefix, text):
    tok = Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix=add_space_prefix))
    assert tok.decode(tok.encode(text)) == text


def test_whitespace_runs_round_trip_without_a_space_prefix():
    """Gemma's case: its runs of spaces are user-defined tokens and it prefixes no space."""
    tok = Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix=False))
    text = "  the   world  "
    ids = tok.encode(text)
    assert tok.convert_ids_to_tokens(ids) == ["  ", "t", "he", "  ", SPACE + "world", "  "]
    assert tok.decode(ids) == text


def test_with_a_space_prefix_text_after_a_user_defined_token_gets_one_like_llama_cpp():
    """llama.cpp prefixes the space to every stretch of text after a control or user-defined token, so there a
    user-defined token followed by text does not round-trip (SentencePiece itself prefixes the text's start only)."""
    tok = Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix=True))
    ids = tok.encode("a  b")
    assert tok.convert_ids_to_tokens(ids) == [SPACE, "a", "  ", SPACE, "b"]
    assert tok.decode(ids) == "a   b"


def test_a_space_prefix_is_added_before_a_leading_space_like_sentencepiece():
    """SentencePiece (0.2.3, add_dummy_prefix, identity normalization) encodes " the world" as ▁ ▁the ▁w or ld.
    HF's GGUF Llama tokenizer (Metaspace) adds no prefix to text that starts with a space, so it encodes " hello"
    as ▁hello and decodes it back to "hello"."""
    tok = Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix=True))
    ids = tok.encode(" hello")
    assert tok.convert_ids_to_tokens(ids) == [SPACE, SPACE + "hello"]  # the prefix plus the text's own space
    assert tok.decode(ids) == " hello"


def test_a_pair_ranks_by_its_pieces_score_not_its_id():
    """SentencePiece joins the adjacent pair whose joined piece scores highest: "ab" vs "bc" decides "abc"."""
    assert pieces(spm_meta(add_space_prefix=False), "abc") == ["ab", "c"]
    swapped = spm_meta(add_space_prefix=False, score_of={"ab": -14.0, "bc": -12.0})  # same ids, other scores
    assert pieces(swapped, "abc") == ["a", "bc"]


def test_characters_outside_the_vocabulary_fall_back_to_bytes():
    tok = Tokenizer.from_gguf_metadata(spm_meta())
    ids = tok.encode("hi 🤖")
    assert tok.convert_ids_to_tokens(ids) == [SPACE, "h", "i", SPACE, "<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
    assert tok.decode(ids) == "hi 🤖"


def test_without_byte_tokens_a_run_of_unknown_characters_is_one_unk():
    meta = spm_meta(add_space_prefix=False, with_bytes=False)
    assert pieces(meta, "a🤖é🤖b") == ["a", "<unk>", "b"]


def test_control_tokens_are_one_special_id_and_user_defined_ones_match_whole():
    meta = spm_meta(add_space_prefix=False)
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("<start_of_turn>hello<br>world<end_of_turn>")
    assert tok.convert_ids_to_tokens(ids) == [
        *("<start_of_turn>", "he", "llo", "<br>", "w", "or", "ld", "<end_of_turn>")
    ]
    assert ids[0] == meta.tokens.index("<start_of_turn>") and ids[-1] == meta.tokens.index("<end_of_turn>")
    assert tok.decode(ids) == "hello<br>world"  # control tokens skipped, the user-defined one kept
    assert tok.decode(ids, skip_special_tokens=False) == "<start_of_turn>hello<br>world<end_of_turn>"
    assert tok.convert_ids_to_tokens(tok.encode("a  b")) == ["a", "  ", "b"]  # the whitespace-run token, whole


def test_the_space_prefix_follows_each_control_token_like_llama_cpp():
    """llama.cpp prepends the space to each stretch of text after a control or user-defined token; HF's Llama
    tokenizer (Metaspace, prepend_scheme="first") only to the first stretch."""
    assert pieces(spm_meta(), "<start_of_turn>hello") == ["<start_of_turn>", SPACE + "hello"]


def test_bos_eos_and_end_of_turn():
    meta = spm_meta(add_bos_token=True)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("the") == [meta.tokens.index("<s>"), meta.tokens.index(SPACE + "the")]
    assert tok.encode("the", add_special_tokens=False) == [meta.tokens.index(SPACE + "the")]
    assert tok.eos_token_ids == (meta.tokens.index("</s>"), meta.tokens.index("<end_of_turn>"))
    assert set(tok.all_special_ids) == {meta.tokens.index(t) for t, kind in SPECIALS if kind == CONTROL}


def test_an_unknown_tokenizer_model_is_a_clear_error():
    with pytest.raises(ModelLoadError, match=r"'t5' is not supported; we build byte-level BPE .* SentencePiece"):
        build_gguf_tokenizer(dataclasses.replace(spm_meta(), model="t5"))


def test_a_sentencepiece_vocabulary_without_scores_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="no tokenizer.ggml.scores"):
        build_gguf_tokenizer(dataclasses.replace(spm_meta(), scores=()))


# ---------------------------------------------------------------------------------------------- GGUF metadata


def write_tokenizer_gguf(path: Path, meta: GGUFTokenizerMetadata, **keys: tuple | None) -> Path:
    """A GGUF holding only `meta`'s tokenizer keys; `keys` overrides one (key -> (value, GGUFValueType[, item
    type]) with "." for "__" in its name, or None to leave it out)."""
    import gguf
    from gguf import GGUFValueType as V

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(0)
    writer.add_tokenizer_model(meta.model)
    writer.add_token_list(list(meta.tokens))
    writer.add_token_types(list(meta.token_types))
    writer.add_token_scores(list(meta.scores))
    writer.add_bos_token_id(meta.bos_token_id)
    writer.add_eos_token_id(meta.eos_token_id)
    writer.add_unk_token_id(meta.unk_token_id)
    writer.add_add_bos_token(meta.add_bos_token)
    writer.add_key_value("tokenizer.ggml.add_space_prefix", meta.add_space_prefix, V.BOOL)
    for name, value in keys.items():
        key = name.replace("__", ".")
        writer.kv_data[0].pop(key, None)
        if value is not None:
            writer.add_key_value(key, *value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_reads_scores_and_the_space_prefix(tmp_path):
    meta = spm_meta(add_space_prefix=False, add_bos_token=True)
    read = gguf_tokenizer_metadata(open_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", meta)))
    assert read == meta


def test_absent_flags_default_to_llama_cpps_for_sentencepiece(tmp_path):
    """llama.cpp (and HF) prefix a space and add BOS for a "llama" vocabulary that does not say otherwise."""
    path = write_tokenizer_gguf(
        tmp_path / "t.gguf",
        spm_meta(add_space_prefix=False),
        tokenizer__ggml__add_space_prefix=None,
        tokenizer__ggml__add_bos_token=None,
    )
    read = gguf_tokenizer_metadata(open_gguf(path))
    assert (read.add_space_prefix, read.add_bos_token) == (True, True)


def test_absent_flags_stay_off_for_byte_level_bpe(tiny_gguf):
    read = gguf_tokenizer_metadata(open_gguf(tiny_gguf("llama")[0]))
    assert (read.model, read.scores, read.add_space_prefix, read.add_bos_token) == ("gpt2", (), False, False)


@pytest.mark.parametrize("key", ["scores", "token_type"])
def test_a_per_token_array_of_the_wrong_length_is_a_clear_error(tmp_path, key):
    from gguf import GGUFValueType as V

    value = ([0.0] * 3, V.ARRAY, V.FLOAT32) if key == "scores" else ([1] * 3, V.ARRAY, V.INT32)
    path = write_tokenizer_gguf(tmp_path / "t.gguf", spm_meta(), **{f"tokenizer__ggml__{key}": value})
    num_tokens = len(spm_meta().tokens)
    with pytest.raises(ModelLoadError, match=rf"{key} has 3 entries but tokenizer.ggml.tokens has {num_tokens}"):
        gguf_tokenizer_metadata(open_gguf(path))


HF_TEXTS = ["hello world", "hello\n\tworld ", "the abc 12 123", "héllo 🤖 world", "wor ld "]


def test_tiny_vocabulary_ids_match_hfs_gguf_tokenizer(tmp_path):
    """With a space prefix (HF ignores add_space_prefix=False here), on texts without a leading space, control
    tokens or whitespace runs, where HF's Llama tokenizer departs from SentencePiece and llama.cpp (see above)."""
    transformers = pytest.importorskip("transformers")
    meta = spm_meta(add_space_prefix=True, add_bos_token=True)
    write_tokenizer_gguf(tmp_path / "t.gguf", meta)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    tok = Tokenizer.from_gguf_metadata(meta)
    for text in HF_TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


# ---------------------------------------------------------------------------------------------- Gemma 3
# The real vocabulary: 262,144 tokens, add_space_prefix False, whitespace-run and HTML user-defined tokens.

GEMMA_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n\n\n    return fib(n - 1) + fib(n - 2)  # two  spaces\n",
    "\tindented\t\ttabs\n\t\t\tdeeper\r\n    four spaces\n        eight\n" + " " * 17 + "seventeen",
    "x=1;y=22;z=333;w=4444 version 12.0.1 ip 192.168.0.1 pi 3.14159 1,000,000",
    "東京は日本の首都です。中文测试，한국어 테스트",
    "Ünïcödé ßtraße ελληνικά русский العربية हिन्दी ไทย",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷 skin 👍🏽",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "a <start_of_turn> inside text<end_of_turn>",
    "   leading spaces",
    "trailing spaces   ",
    " one leading, one trailing ",
    "<table><tr><td>cell</td></tr></table> and <b>bold</b>",
    "naïve café résumé — “quotes” … ½ ©",
    "",
]


@pytest.fixture(scope="module")
def gemma_meta(gemma3_path) -> GGUFTokenizerMetadata:
    return gguf_tokenizer_metadata(open_gguf(gemma3_path))


@pytest.fixture(scope="module")
def gemma(gemma_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_meta)


@pytest.fixture(scope="module")
def hf_gemma(gemma3_path):
    """HF's GGUF converter (~30 s on 2 cores: it derives the merges in Python; the tests using it are `slow`)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name)


@pytest.mark.real_model
def test_gemma3_vocabulary_builds_in_seconds(gemma_meta):
    """262,144 pieces, ~515k merges: ~2 s on a 2-core Zen 3 (merges ~1.2 s); the bound only catches a blow-up."""
    start = time.perf_counter()
    backend = build_gguf_tokenizer(gemma_meta)
    assert time.perf_counter() - start < 20
    assert backend.get_vocab_size(with_added_tokens=True) == len(gemma_meta.tokens) == 262144


@pytest.mark.real_model
def test_gemma3_special_ids(gemma):
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.eos_token_ids) == (2, 1, (1, 106))
    assert gemma.encode("hi")[0] == 2 and gemma.encode("hi", add_special_tokens=False)[0] != 2
    assert gemma.encode("<start_of_turn>", add_special_tokens=False) == [105]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma3_ids_match_hf(gemma, hf_gemma, text):
    ids = gemma.encode(text)
    assert ids == hf_gemma.encode(text)
    assert gemma.decode(ids, skip_special_tokens=False) == hf_gemma.decode(ids, skip_special_tokens=False)
    assert gemma.decode(ids) == hf_gemma.decode(ids, skip_special_tokens=True)
    if "<start_of_turn>" not in text:
        assert gemma.decode(ids) == text


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_wikitext_ids_match_hf(gemma, hf_gemma):
    """The first 200 lines of WikiText-2's test split (CRLF kept), one by one and as one text."""
    from leanlm.data import wikitext2_test_path

    with open(wikitext2_test_path(), encoding="utf-8", newline="") as f:
        lines = [next(f) for _ in range(200)]
    for line in lines:
        ids = gemma.encode(line)
        assert ids == hf_gemma.encode(line), line
        assert gemma.decode(ids) == line
    text = "".join(lines)
    assert gemma.encode(text) == hf_gemma.encode(text)


@pytest.mark.real_model
def test_gemma3_long_whitespace_runs_split_longest_first_like_sentencepiece(gemma):
    """Gemma's runs of 2..31 spaces are user-defined pieces, which SentencePiece (and llama.cpp) match whole,
    longest first: 40 spaces are 31 + 9 (checked with sentencepiece 0.2.3 on a model with the same pieces).
    HF's GGUF converter re-spells them as "▁▁".. BPE pieces merged by file order instead and gives 16 + 24."""
    ids = gemma.encode("x" + " " * 40 + "y", add_special_tokens=False)
    assert gemma.convert_ids_to_tokens(ids) == ["x", " " * 31, " " * 9, "y"]


@pytest.mark.real_model
def test_gemma3_streams_byte_fallback_characters_whole(gemma):
    """Byte tokens of one character decode to U+FFFD until the last arrives; the detokenizer holds them back."""
    from leanlm.loading.tokenizer import IncrementalDetokenizer

    text = "Sure \U0001fae8 and \u0d9e then 東京  done"  # U+1FAE8 and U+0D9E are not in the vocabulary
    ids = gemma.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in gemma.convert_ids_to_tokens(ids))  # some character falls back to bytes
    detok = IncrementalDetokenizer(gemma, gemma.encode("Answer:"))
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
