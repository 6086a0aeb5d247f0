"""/v1/embeddings through the real `openai` client against the real SmolLM2: base64 (the client's default) and
float encodings agree, token-id and text inputs agree, similar sentences score closer than unrelated ones, embeddings
batch beside a streamed chat, and refusals come in OpenAI's error shape."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.real_model

SENTENCES = [
    "The cat sat on the mat.",
    "A kitten was resting on the rug.",
    "Interest rates rose by half a point at the central bank's meeting.",
]


def _vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float64)


def test_embeddings_float_and_base64_agree_and_rank_similarity(openai_client, real_llm):
    by_default = openai_client.embeddings.create(model=MODEL, input=SENTENCES)  # the client asks for base64
    as_floats = openai_client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    a, b = _vectors(by_default), _vectors(as_floats)
    assert a.shape == (3, real_llm.model_config.hidden_size)
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    similarity = a @ a.T
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[1, 2]
    tokenizer = real_llm.get_tokenizer()
    assert by_default.usage.prompt_tokens == sum(len(tokenizer.encode(s)) for s in SENTENCES)
    assert by_default.model == MODEL and [d.index for d in by_default.data] == [0, 1, 2]

    ids = tokenizer.encode(SENTENCES[0])
    from_ids = openai_client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose(_vectors(from_ids)[0], b[0], atol=1e-5)


def test_mean_pooling_extension_and_unnormalized(openai_client):
    last = _vectors(openai_client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float"))
    mean = openai_client.embeddings.create(
        model=MODEL, input=SENTENCES[0], encoding_format="float", extra_body={"pooling": "mean", "normalize": False}
    )
    mean = _vectors(mean)
    assert not np.allclose(last, mean) and abs(np.linalg.norm(mean) - 1.0) > 1e-3


def test_embeddings_batch_beside_a_streamed_chat(openai_client):
    texts = []

    def chat():
        stream = openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=40, stream=True
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    thread = threading.Thread(target=chat)
    thread.start()
    alone = _vectors(openai_client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float"))
    thread.join(120)
    assert texts and texts[0]
    again = _vectors(openai_client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float"))
    np.testing.assert_allclose(alone, again, atol=1e-5)


def test_embedding_refusals_are_openai_errors(openai_client, real_llm):
    openai = pytest.importorskip("openai")
    hidden = real_llm.model_config.hidden_size
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model=MODEL, input="hi", dimensions=hidden // 2)
    assert err.value.body["param"] == "dimensions" and str(hidden) in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model=MODEL, input=[])
    assert err.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.embeddings.create(model="no-such-model", input="hi")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model=MODEL, input=[10**9])
    assert "vocabulary" in err.value.body["message"]
    assert openai_client.embeddings.create(model=MODEL, input="hi", dimensions=hidden).data
