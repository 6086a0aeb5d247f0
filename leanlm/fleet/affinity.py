"""The affinity key of a request for the router: the hashes of its prompt's leading KV blocks, from the model's
tokenizer in the front (chat messages through the chat template), reading only as much text as those blocks need."""

from __future__ import annotations

from typing import Any

import pydantic_core

from leanlm.fleet.router import prefix_block_hashes
from leanlm.loading.tokenizer import Tokenizer

# Characters read per token wanted: BPE tokens of text average 3-5 characters; 16 leaves room for odd text.
CHARS_PER_TOKEN_BOUND = 16


class PromptKeyer:
    """`keyer(path, raw_body)` -> the block hashes the router matches on; () when the body names no usable prompt
    (the replica then answers it, a bad body with its own 400)."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, max_blocks: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_chars = block_size * max_blocks * CHARS_PER_TOKEN_BOUND

    def __call__(self, path: str, raw: bytes) -> tuple[int, ...]:
        try:
            body = pydantic_core.from_json(raw)  # bounded nesting (json.loads raised RecursionError)
        except ValueError:
            return ()
        return self.key(path, body)

    def key(self, path: str, body: Any) -> tuple[int, ...]:
        """The block hashes of an already parsed body."""
        if not isinstance(body, dict):
            return ()
        try:
            ids = self.chat_ids(body.get("messages")) if path.endswith("/chat/completions") else None
            if ids is None:
                ids = self.prompt_ids(body.get("prompt"))
        except Exception:  # a template that refuses these messages, odd content parts: the replica will say why
            return ()
        return prefix_block_hashes(ids, self.block_size, self.max_blocks)

    def prompt_ids(self, prompt: Any) -> list[int]:
        """The first prompt of a completion request: text, token ids, or a list of either."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._text_ids(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []

    def chat_ids(self, messages: Any) -> list[int] | None:
        if not isinstance(messages, list) or not messages:
            return None
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self._text_ids(text, add_special_tokens=False)

    def _text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= self.max_chars:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # A cut can merge its last token differently from the whole text: drop it.
        return self.tokenizer.encode(text[: self.max_chars], add_special_tokens=add_special_tokens)[:-1]
