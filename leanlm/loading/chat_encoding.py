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
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids) for `messages` through the model's chat template, rendered to at most
    `max_chars` characters (ChatTemplateError beyond). `tools`: the template's `tools` variable (HF's shape)."""
    check_mode(mode)
    variables = {"tools": tools} if tools is not None else {}
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, max_chars=max_chars, **variables
    )
    pattern = tokenizer.control_token_pattern
    # the tools' names, descriptions and schemas are the client's text too: scanned and masked as one more turn
    scanned = messages + ([{"tools": tools}] if tools else [])
    found = [] if pattern is None or mode == "parse" else _control_tokens_in(scanned, pattern)
    if not found:  # the common case: nothing to tell apart, one encode as before
        return text, tokenizer.encode(text, add_special_tokens=False)
    if mode == "reject":
        index, token = found[0]
        where = f"message {index}" if index < len(messages) else "a tool definition"
        raise ControlTokenError(
            f"{where} contains the control token {token!r}, which this server refuses in messages "
            f"(it could forge another role's turn); remove it, or start the server with --chat-control-tokens text"
        )
    # Render again with each control token in a message replaced by a marker no template emits; the marked
    # prompt is encoded piece by piece: the template's text as usual, each marker as the token's plain text.
    nonce = secrets.token_hex(8)
    tokens = list(tokenizer.control_token_text_ids)
    marker = {token: f"\ue000{nonce}:{k}\ue001" for k, token in enumerate(tokens)}
    masked = [_masked(message, pattern, marker) for message in messages]
    if tools is not None:
        variables = {"tools": _mask(tools, pattern, marker)}
    # Each marker is a few times longer than the token it stands for: the marked render gets that much room.
    marked = tokenizer.apply_chat_template(
        masked, add_generation_prompt=add_generation_prompt, max_chars=3 * max_chars, **variables
    )
    ids: list[int] = []
    for k, piece in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)):
        if k % 2:  # a captured marker index
            ids.extend(tokenizer.control_token_text_ids[tokens[int(piece)]])
        elif piece:
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return text, ids


def _control_tokens_in(messages: list[dict[str, Any]], pattern: re.Pattern) -> list[tuple[int, str]]:
    """(message index, control token) for every message field but its role that holds a control token, at any depth
    (a tool call's arguments too)."""
    found = []
    for index, message in enumerate(messages):
        for key, value in message.items():
            if key != "role" and (match := _first_match(value, pattern)):
                found.append((index, match))
    return found


def _first_match(value: Any, pattern: re.Pattern) -> str | None:
    if isinstance(value, str):
        match = pattern.search(value)
        return match.group() if match else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((m for item in items if (m := _first_match(item, pattern))), None)


def _masked(message: dict[str, Any], pattern: re.Pattern, marker: dict[str, str]) -> dict[str, Any]:
    return {key: value if key == "role" else _mask(value, pattern, marker) for key, value in message.items()}


def _mask(value: Any, pattern: re.Pattern, marker: dict[str, str]) -> Any:
    """Every string in value (nested dicts and lists too) with each control token replaced by its marker."""
    if isinstance(value, str):
        return pattern.sub(lambda m: marker[m.group()], value)
    if isinstance(value, dict):
        return {k: _mask(v, pattern, marker) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, pattern, marker) for v in value]
    return value
