"""A mixture-of-experts model behind the OpenAI server: the real openai client pins experts through extra_body,
a bad expert list is a 400 that leaves the server serving, and /metrics shows the routing."""

from __future__ import annotations

import pytest
import requests

from tests.engine.test_moe_engine import make_moe_engine  # noqa: F401  (the fixture)
from tests.server.conftest import MODEL, serve_engine

openai = pytest.importorskip("openai")


def test_pinned_experts_bad_lists_and_metrics(make_moe_engine):  # noqa: F811
    engine = make_moe_engine()
    with serve_engine(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                         extra_body={"experts": [1, 3], "ignore_eos": True})  # fmt: skip
        assert done.usage.completion_tokens == 4
        assert all(load[0] == load[2] == 0 for load in engine.moe_stats().expert_load)
        for bad in ([9, 1], [2], [-1, 2]):
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"experts": bad})
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.content is not None  # still serving, every expert again
        page = requests.get(server.url + "/metrics", timeout=10).text
        assert 'leanlm_moe_expert_assignments_total{expert="0",layer="0"' in page
        assert "leanlm_moe_dropped_total" in page and "leanlm_moe_expert_bytes_per_token" in page
