"""Gemma 3 270M (the registry's "gemma3-270m", a real second architecture from its GGUF): its logits equal HF
transformers' on the same dequantized weights, through our paged, chunked forward; its greedy text makes sense."""

import pytest
import torch

from leanlm import LLM, SamplingParams
from tests.model.test_llama import _paged_logits

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.mark.slow  # HF dequantizes the file in ~55 s on 2 cores
def test_gemma3_logits_equal_hf_on_the_same_dequantized_weights(gemma3_path):
    transformers = pytest.importorskip("transformers")
    from leanlm.formats.loader import load_checkpoint

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_path.parent), gguf_file=gemma3_path.name, dtype=torch.float32
    ).eval()
    checkpoint = load_checkpoint(str(gemma3_path), "float32", "cpu", progress=False)  # dequantized, as HF
    ours, tokenizer = checkpoint.model, checkpoint.tokenizer
    ids = torch.tensor(tokenizer.encode(PROMPT))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[None]).logits[0].double(), -1)
        got = torch.log_softmax(_paged_logits(ours, ids, [len(ids) - 3, 1, 1, 1], list(range(16))).double(), -1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert tokenizer.decode([int(ref[-1].argmax())]).strip() == "Rome"


def test_gemma3_greedy_text_makes_sense(gemma3_path):
    prompts = ["The three primary colors are", "def fibonacci(n):", PROMPT]
    with LLM(str(gemma3_path), dtype="float32", progress=False) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    colors, code, capital = (o.outputs[0].text for o in outs)
    assert all(c in colors for c in ("red", "blue", "yellow")), colors
    assert "return" in code and "n" in code, code
    assert capital.split()[0].strip(".,") == "Rome", capital
