"""A prompt the model's tokenizer panics on (issue 47 item 6) is a JSON 400 from a real server on loopback, like every
other bad request; before, pyo3's PanicException (a BaseException) escaped the error mapping as plain text."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch
from tokenizers import Tokenizer as HFTokenizer

from leanlm.config.engine import EngineConfig
from leanlm.engine.engine import LLMEngine
from leanlm.loading.tokenizer import Tokenizer
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict
from tests.loading.test_tokenizer import RUNTIME_PANIC_PATTERN, RUNTIME_PANIC_TEXT, panicking_tokenizer_json
from tests.server.conftest import MODEL, serve_engine
from tests.tiny_tokenizer import tiny_tokenizer


def _post(url: str, body: dict) -> tuple[int, str, str]:
    """(status, Content-Type, body text) of a JSON POST; an HTTP error status is an answer too."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def test_a_prompt_the_tokenizer_panics_on_is_a_json_400(tmp_path):
    base = tiny_tokenizer()
    backend = HFTokenizer.from_str(panicking_tokenizer_json(RUNTIME_PANIC_PATTERN))
    tokenizer = Tokenizer(backend, base.bos_token, base.eos_token, base.chat_template)
    config = tiny_config(tokenizer.vocab_size)
    model = build_model(config, tiny_state_dict(config), torch.float32)
    engine = LLMEngine(
        model, tokenizer, EngineConfig.from_options(kv_cache_memory_bytes=8 << 20), torch.device("cpu"), torch.float32
    )
    with serve_engine(engine) as server:
        for path, body in (
            ("/v1/completions", {"prompt": RUNTIME_PANIC_TEXT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": RUNTIME_PANIC_TEXT}]}),
        ):
            status, content_type, text = _post(server.url + path, {"model": MODEL, "max_tokens": 2, **body})
            assert status == 400 and content_type.startswith("application/json"), (status, text)
            error = json.loads(text)["error"]
            assert error["type"] == "invalid_request_error" and "tokenizer failed on this text" in error["message"]
        # the server (and its tokenizer) goes on serving
        status, _, text = _post(server.url + "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 2})
        assert status == 200, text
