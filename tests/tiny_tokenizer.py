"""A small byte-level BPE tokenizer built in code, so engine, server and CLI tests need no model package.

Trained in memory on a few sentences (deterministic): 256 byte tokens, merges up to VOCAB_SIZE, ChatML special
tokens and a ChatML chat template, the shape of SmolLM2's tokenizer at a fraction of its size.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from leanlm.loading.tokenizer import Tokenizer

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    """The three primary colors are red, yellow and blue. Paris is the capital of France; Berlin is the
capital of Germany. Once upon a time, in a small village at the edge of a great forest, there lived an old
clockmaker who made clocks for everyone. def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of Italy? Rome is. 0123456789
A story about a robot who learns to paint. Tell me a joke. Write a poem about the sea and the sky at night.
Large language models predict the next token. Speculative decoding drafts tokens and verifies them.
""".split("\n")
    + [" ".join(f"{w}{i}" for w in ("item", "page", "step", "row")) for i in range(700)]
)


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_CORPUS * 8, trainer)
    return Tokenizer(backend, bos_token=None, eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
