"""PromptKeyer: the router's affinity key from a request body, the same for prompts that share their first blocks."""

from __future__ import annotations

import json

from leanlm.fleet.affinity import PromptKeyer
from leanlm.fleet.router import prefix_block_hashes

SHARED = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


def key(keyer: PromptKeyer, path: str, body) -> tuple[int, ...]:
    return keyer(path, json.dumps(body).encode() if not isinstance(body, bytes) else body)


def test_completions_share_a_key_when_their_first_blocks_match(tokenizer):
    keyer = PromptKeyer(tokenizer, block_size=4, max_blocks=4)
    first = key(keyer, "/v1/completions", {"prompt": SHARED + "one"})
    assert len(first) == 4
    assert first == key(keyer, "/v1/completions", {"prompt": [SHARED + "two", "other"]})
    assert first != key(keyer, "/v1/completions", {"prompt": "a different start " + SHARED})
    ids = tokenizer.encode(SHARED)
    assert key(keyer, "/v1/completions", {"prompt": ids}) == prefix_block_hashes(ids, 4, 4)


def test_a_long_text_is_cut_without_changing_its_leading_blocks(tokenizer):
    keyer = PromptKeyer(tokenizer, block_size=4, max_blocks=2)
    text = SHARED * 10  # past max_chars = 4 * 2 * 16 = 128 characters
    assert len(text) > keyer.max_chars
    assert key(keyer, "/v1/completions", {"prompt": text}) == prefix_block_hashes(tokenizer.encode(text), 4, 2)


def test_chats_key_on_the_rendered_template(tokenizer):
    keyer = PromptKeyer(tokenizer, block_size=4, max_blocks=4)
    system = {"role": "system", "content": SHARED}
    one = key(keyer, "/v1/chat/completions", {"messages": [system, {"role": "user", "content": "a"}]})
    two = key(keyer, "/v1/chat/completions", {"messages": [system, {"role": "user", "content": "b"}]})
    rendered = tokenizer.apply_chat_template([system, {"role": "user", "content": "a"}])
    assert one == two == prefix_block_hashes(tokenizer.encode(rendered, add_special_tokens=False), 4, 4)


def test_bodies_without_a_usable_prompt_have_no_key(tokenizer):
    keyer = PromptKeyer(tokenizer, block_size=4, max_blocks=4)
    for body in (b"{not json", b"[1, 2]", {"prompt": 5}, {"prompt": []}, {"messages": "hi"}, {}):
        assert key(keyer, "/v1/completions", body) == ()
    assert key(keyer, "/v1/chat/completions", {"messages": []}) == ()
