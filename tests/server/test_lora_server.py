"""LoRA adapters through the real `openai` client: a request picks an adapter by `model` (vLLM's "<adapter>", or
"<base>:<adapter>"), /v1/models lists them, an unknown one is OpenAI's 404 (model_not_found)."""

from __future__ import annotations

import pytest
import torch

from leanlm.config import EngineConfig
from leanlm.engine import LLMEngine
from leanlm.lora_request import LoRARequest
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion, tiny_config, tiny_state_dict
from tests.engine.test_lora_engine import _merged
from tests.server.conftest import MODEL, serve_engine

openai = pytest.importorskip("openai")

PROMPT = [17, 250, 31, 999, 4, 88, 12]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tokenizer):
    from leanlm.formats.peft import write_adapter
    from leanlm.model.lora import lora_target_shapes

    config = tiny_config(tokenizer.vocab_size)
    gen = torch.Generator().manual_seed(3)
    paths = {}
    for name in ("sql", "poem"):
        weights = {n: (torch.randn(4, i, generator=gen) * 0.4, torch.randn(o, 4, generator=gen) * 0.4)
                   for n, (o, i) in lora_target_shapes(config).items()}  # fmt: skip
        paths[name] = str(write_adapter(tmp_path_factory.mktemp(name), weights, 4, 8.0, None))
    return config, tiny_state_dict(config), paths


def _engine(config, state, tokenizer, **options) -> LLMEngine:
    options = {"num_kv_blocks": 64, "block_size": 4, **options}
    model = build_model(config, state, torch.float32)
    return LLMEngine(model, tokenizer, EngineConfig.from_options(**options), torch.device("cpu"), torch.float32)


def _greedy_ids(engine: LLMEngine) -> list[int]:
    engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0))
    (out,) = run_to_completion(engine).values()
    return out.outputs[0].token_ids


def test_requests_pick_adapters_by_model_name(adapters, tokenizer):
    config, state, paths = adapters
    engine = _engine(config, state, tokenizer, enable_lora=True, max_loras=2)
    for name, path in paths.items():
        engine.prepare_lora(engine.lora_manager.register(name, path))
    with serve_engine(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        models = {m.id: m for m in client.models.list().data}
        assert list(models) == [MODEL, "sql", "poem"] and models["sql"].parent == MODEL

        def complete(model: str) -> list[str]:
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
            return reply.choices[0].logprobs.tokens

        base, sql, sql_prefixed, poem = (complete(m) for m in (MODEL, "sql", f"{MODEL}:sql", "poem"))
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
        assert err.value.code == "model_not_found" and "sql" in err.value.message
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=f"{MODEL}:nope", messages=[{"role": "user", "content": "hi"}])
        chat = client.chat.completions.create(
            model="poem", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
        )
        assert chat.model == "poem" and chat.choices[0].message.content is not None
    assert sql == sql_prefixed and len({tuple(base), tuple(sql), tuple(poem)}) == 3
    # each equals its adapter merged into the base, served by an engine without LoRA
    for tokens, merged in ((base, state), (sql, _merged(state, paths["sql"])), (poem, _merged(state, paths["poem"]))):
        ids = _greedy_ids(_engine(config, merged, tokenizer))
        assert tokens == [tokenizer.decode([i]) for i in ids]


def test_an_engine_without_lora_serves_no_adapter(adapters, tokenizer):
    config, state, paths = adapters
    with serve_engine(_engine(config, state, tokenizer)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    engine = _engine(config, state, tokenizer)
    with pytest.raises(ValueError, match="enable_lora"):
        engine.prepare_lora(LoRARequest("sql", paths["sql"]))


def test_lora_modules_flag_parses_name_path_pairs():
    from leanlm.cli.serve import parse_lora_modules

    assert parse_lora_modules(["sql=/a/b", "poem=c=d"]) == {"sql": "/a/b", "poem": "c=d"}
    for bad, message in ((["sql"], "NAME=PATH"), (["a:b=/x"], "no ':'"), (["a=/x", "a=/y"], "twice")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
