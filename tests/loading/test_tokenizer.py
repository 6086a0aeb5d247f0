"""Tokenizer built from GGUF metadata: id parity with HF, decoding, chat template, incremental detokenizing."""

from __future__ import annotations

import pytest

from leanlm.formats.gguf import load_gguf
from leanlm.loading import gguf_tokenizer
from leanlm.loading import tokenizer as tokenizer_module
from leanlm.loading.chat_template import ChatTemplateError
from leanlm.loading.errors import ModelLoadError
from leanlm.loading.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; we've got 3.14159 and 1,000,000 items.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))\n",
    "naïve café résumé — “quotes” …",
    "東京は日本の首都です。中文测试，韩国어 테스트",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷 skin 👍🏽",
    "   leading spaces\t\ttabs   trailing   \n\n\n  \r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you'LL see they've DONE it",
    "Ünïcödé ßtraße ελληνικά русский العربية हिन्दी",
    "x=1;y=22;z=333;w=4444 version 12.0.1 ip 192.168.0.1",
]

MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hf(smollm, hf_tokenizer, text):
    assert smollm.tokenizer.encode(text) == hf_tokenizer.encode(text)


def test_whitespace_before_digits_follows_llama_cpp(smollm, hf_tokenizer):
    """SmolLM2 ('smollm' pre-tokenizer) isolates digits *before* GPT-2's regex, like llama.cpp and the model's own
    tokenizer.json (Digits + ByteLevel). HF's GGUF conversion skips the digit split, so "a  1" differs there."""
    tok = smollm.tokenizer
    ids = tok.encode("a  1")
    assert tok.convert_ids_to_tokens(ids) == ["a", "\u0120\u0120", "1"]
    assert hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("a  1")) == ["a", "\u0120", "\u0120", "1"]
    assert tok.encode("12345") == [tok.backend.token_to_id(d) for d in "12345"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(smollm, hf_tokenizer, text):
    tok = smollm.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens(smollm, hf_tokenizer):
    tok = smollm.tokenizer
    assert tok.encode("<|im_start|>") == [1]  # whole, not split into pieces
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2, 0))
    assert tok.vocab_size == 49152 == len(hf_tokenizer)
    assert set(tok.all_special_ids) == set(range(17))  # the 17 control tokens of the GGUF
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)  # add_bos=False
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smollm, hf_tokenizer, messages, add_generation_prompt):
    ours = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref
    ids = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == smollm.tokenizer.encode(ours, add_special_tokens=False)


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, tok.bos_token, tok.eos_token, template)


def test_no_chat_template(smollm):
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(smollm.tokenizer, None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_features(smollm):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ bos_token }}{{ m.content | tojson }}\n{% endfor %}{{ eos_token }}"
    )
    tok = _with_template(smollm.tokenizer, template)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>"é"\n<|im_end|>'
    with pytest.raises(ChatTemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(smollm):
    tok = _with_template(smollm.tokenizer, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


HOSTILE_TEMPLATES = [
    "{{ 'a' * 10**7 }}",  # one operation builds a huge value
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # loops, no output
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",  # output grows without bound
    "{{ 'x'.ljust(10**9) }}",
    "{{ '{:>1000000000}'.format('a') }}",
    "{{ '%1000000000s' % 'a' }}",
]


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES)
def test_hostile_templates_stop_with_a_clear_error(smollm, source):
    """A template from a model file must not render for ever or without end (not in LLM.chat, not in serve)."""
    import time

    from leanlm.loading.chat_template import RENDER_TIMEOUT_S

    tok = _with_template(smollm.tokenizer, source)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="limit|longer than|more than"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < RENDER_TIMEOUT_S + 1


def test_render_limits_are_per_call(smollm):
    from leanlm.loading.chat_template import render_chat_template

    messages = [{"role": "user", "content": "x" * 100}]
    assert render_chat_template("{{ messages[0].content * 2 }}", messages, max_chars=200) == "x" * 200
    with pytest.raises(ChatTemplateError, match="limit"):
        render_chat_template("{{ messages[0].content * 3 }}", messages, max_chars=200)
    with pytest.raises(ChatTemplateError, match="longer than 0.2 s"):
        render_chat_template(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", messages, timeout_s=0.2
        )


@pytest.mark.parametrize("text,splits_chars", [(TEXTS[4], True), (TEXTS[5], True), (TEXTS[2] + TEXTS[3], False)])
def test_incremental_detokenizer_matches_full_decode(smollm, text, splits_chars):
    tok = smollm.tokenizer
    prompt = tok.encode("Answer: ")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # never half a character
    assert ("" in deltas) == splits_chars  # emoji/CJK bytes really are split across tokens


def test_incremental_detokenizer_skips_special_and_batches(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("<|im_start|>assistant\nSure 👍<|im_end|>")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    out = detok.step(ids[:3]) + "".join(detok.step([i]) for i in ids[3:])
    assert out == tok.decode(ids) == "assistant\nSure 👍"
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(keep.step([i]) for i in ids) == tok.decode(ids, skip_special_tokens=False)


def test_incremental_detokenizer_decodes_a_small_window(smollm):
    """O(1) per token: each step decodes only the few tokens since the last complete character."""
    tok = smollm.tokenizer
    lengths: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS) * 3)
    detok = IncrementalDetokenizer(Counting(), tok.encode("prompt " * 50))
    for i in ids:
        detok.step([i])
    assert detok.text == tok.decode(ids)
    assert len(ids) > 500 and max(lengths) <= 12


def test_incremental_detokenizer_flushes_invalid_utf8_after_a_few_tokens(smollm):
    """Forced byte tokens that never form a character (logit_bias can force them) are emitted as U+FFFD after
    a few held tokens; holding them back for ever made every step decode the whole held run."""
    tok = smollm.tokenizer
    stray = next(i for i in range(1000) if tok.decode([i]) == "\ufffd")  # a lone UTF-8 continuation byte
    lengths: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode("Hi") + [stray] * 2000 + tok.encode(" there 👍")
    detok = IncrementalDetokenizer(Counting(), tok.encode("prompt"))
    deltas = [detok.step([i]) for i in ids]
    assert max(lengths) <= 20  # the window stays a few tokens wide
    assert detok.text == tok.decode(ids)  # nothing lost: every stray byte shows as one U+FFFD
    assert detok.text.count("\ufffd") == 2000 and detok.text.endswith(" there 👍")
    assert sum(1 for d in deltas if "\ufffd" in d) >= 2000 // 8


def test_incremental_detokenizer_flush_gives_a_held_tail_at_the_end(smollm):
    """A sequence that ends inside a character (a length limit mid-emoji): the held bytes come out at the end as
    U+FFFD, so the final text equals decoding every id (a finished request's text used to lack them)."""
    tok = smollm.tokenizer
    ids = tok.encode("Sure 👍")
    detok = IncrementalDetokenizer(tok, [])
    emitted = "".join(detok.step([i]) for i in ids[:-1])  # stop one token short of the emoji's last byte
    assert "\ufffd" not in emitted and emitted != tok.decode(ids[:-1])  # its first bytes are held back
    assert emitted + detok.flush() == detok.text == tok.decode(ids[:-1])
    assert detok.text.endswith("\ufffd") and detok.flush() == ""  # nothing held twice


def test_qwen2_split_regex_is_hfs(tiny_gguf):
    pytest.importorskip("transformers")
    from transformers.models.qwen2 import tokenization_qwen2

    assert gguf_tokenizer._QWEN2_SPLIT == tokenization_qwen2.PRETOKENIZE_REGEX
    _, _, meta = load_gguf(tiny_gguf("qwen2", True)[0], progress=False)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert meta.pre == "qwen2"
    assert tok.convert_ids_to_tokens(tok.encode("he said 42")) == [
        "he",
        "\u0120",
        "s",
        "a",
        "i",
        "d",
        "\u0120",
        "4",
        "2",
    ]


# ---------------------------------------------------------------------------------------------- tokenizer panics
# A Split pre-tokenizer whose regex backtracks exponentially makes the Rust tokenizer panic (Onig's retry limit)
# on a matching text: pyo3 raises a PanicException, a BaseException, which escaped every `except Exception`.


def panicking_tokenizer_json(pattern: str) -> str:
    """The tiny test tokenizer with a Split(`pattern`) pre-tokenizer in front of its byte-level one."""
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from tests.tiny_tokenizer import tiny_tokenizer

    backend = HFTokenizer.from_str(tiny_tokenizer().backend.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), "isolated"), backend.pre_tokenizer]
    )
    return backend.to_str()


# passes every load probe (single-character runs), panics on a long run of "ab" not at the end of the text
RUNTIME_PANIC_PATTERN = "((ab)+)+$"
RUNTIME_PANIC_TEXT = "ab" * 60 + "c"


def _save_tokenizer_dir(path, pattern: str):
    from tests.tiny_tokenizer import tiny_tokenizer

    tiny_tokenizer().save(path)
    (path / "tokenizer.json").write_text(panicking_tokenizer_json(pattern))
    return path


def test_a_tokenizer_panic_on_encode_is_a_tokenizer_error(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_str(panicking_tokenizer_json(RUNTIME_PANIC_PATTERN))
    with pytest.raises(BaseException) as caught:  # the bare backend panics: what reached users before
        raw.encode(RUNTIME_PANIC_TEXT)
    assert not isinstance(caught.value, Exception) and type(caught.value).__name__ == "PanicException"
    tok = Tokenizer.from_dir(_save_tokenizer_dir(tmp_path, RUNTIME_PANIC_PATTERN))
    with pytest.raises(tokenizer_module.TokenizerError, match="tokenizer failed on this text") as caught:
        tok.encode(RUNTIME_PANIC_TEXT)
    assert isinstance(caught.value, ValueError)  # what the server answers 400 and the CLI prints as one line
    assert tok.encode("abc ab") == raw.encode("abc ab").ids  # the backend still works after its panic
    with pytest.raises(tokenizer_module.TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": RUNTIME_PANIC_TEXT}], tokenize=True)


def test_a_tokenizer_that_panics_on_a_probe_is_refused_at_load(tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer.json cannot encode a run of 'a' .*panics"):
        Tokenizer.from_dir(_save_tokenizer_dir(tmp_path, "(a+)+$"))


def test_the_real_tokenizer_passes_the_load_probes(smollm_dir, tmp_path):
    """The probes refuse no sound tokenizer: SmolLM2's, saved as a tokenizer.json, loads and round-trips them."""
    from leanlm.formats.gguf import open_gguf
    from leanlm.formats.gguf.tokenizer import gguf_tokenizer_metadata

    gguf_file = smollm_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(gguf_file))).save(tmp_path)
    real = Tokenizer.from_dir(tmp_path)
    for text in tokenizer_module._PROBES:
        assert real.decode(real.encode(text, add_special_tokens=False)) == text
