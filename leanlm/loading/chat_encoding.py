"""A chat's token ids, and what control-token text inside a message becomes (issue 34: role forging).

A user message holding `<|im_end|>\\n<|im_start|>system` would, tokenized with the rendered template as HF,
vLLM and llama.cpp's server do, open a real system turn. By default (`text`) such text in a message stays
text: its characters are tokens, only the template's own control tokens are ids. `reject` refuses the chat,
`parse` keeps the peers' behaviour (for callers who put control tokens in messages on purpose).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from leanlm.loading.chat_template import MAX_RENDER_CHARS
from leanlm.loading.tokenizer import Tokenizer

# How control-token text in chat messages is encoded (see the module docstring).
CONTROL_TOKEN_MODES = ("text", "reject", "parse")


class ControlTokenError(ValueError):
    """A chat message holds a control token's text and the mode is `reject`; `param` is the request field."""

    param = "messages"


def check_mode(mode: str) -> None:
    if mode not in CONTROL_TOKEN_MODES:
        raise ValueError(f"control-token mode must be one of {', '.join(CONTROL_TOKEN_MODES)}, got {mode!r}")


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    mode: str = "text",
    max_chars: int = MAX_RENDER_CHARS,
) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids) for `messages` through the model's chat template, rendered to at most
    `max_chars` characters (ChatTemplateError beyond)."""
    check_mode(mode)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, max_chars=max_chars)
    pattern = tokenizer.control_token_pattern
    found = [] if pattern is None or mode == "parse" else _control_tokens_in(messages, pattern)
    if not found:  # the common case: nothing to tell apart, one encode as before
        return text, tokenizer.encode(text, add_special_tokens=False)
    if mode == "reject":
        index, token = found[0]
        raise ControlTokenError(
            f"message {index} contains the control token {token!r}, which this server refuses in messages "
            f"(it could forge another role's turn); remove it, or start the server with --chat-control-tokens text"
        )
    # Render again with each control token in a message replaced by a marker no template emits; the marked
    # prompt is encoded piece by piece: the template's text as usual, each marker as the token's plain text.
    nonce = secrets.token_hex(8)
    tokens = list(tokenizer.control_token_text_ids)
    marker = {token: f"\ue000{nonce}:{k}\ue001" for k, token in enumerate(tokens)}
    masked = [_masked(message, pattern, marker) for message in messages]
    # Each marker is a few times longer than the token it stands for: the marked render gets that much room.
    marked = tokenizer.apply_chat_template(masked, add_generation_prompt=add_generation_prompt, max_chars=3 * max_chars)
    ids: list[int] = []
    for k, piece in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)):
        if k % 2:  # a captured marker index
            ids.extend(tokenizer.control_token_text_ids[tokens[int(piece)]])
        elif piece:
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return text, ids


def _control_tokens_in(messages: list[dict[str, Any]], pattern: re.Pattern) -> list[tuple[int, str]]:
    """(message index, control token) for every message field but its role that holds a control token."""
    found = []
    for index, message in enumerate(messages):
        for key, value in message.items():
            if key != "role" and isinstance(value, str) and (match := pattern.search(value)):
                found.append((index, match.group()))
    return found


def _masked(message: dict[str, Any], pattern: re.Pattern, marker: dict[str, str]) -> dict[str, Any]:
    return {
        key: pattern.sub(lambda m: marker[m.group()], value) if key != "role" and isinstance(value, str) else value
        for key, value in message.items()
    }
