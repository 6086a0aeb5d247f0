"""Sliding-window models served as trained, against HF transformers (float64) on tiny configs at 4x the window:
Mistral (every layer), Qwen2's use_sliding_window from max_window_layers on, and a `layer_types` alternation
(Gemma-2's full / sliding interleave). The forwards run through an engine, whose KV cache frees the blocks that
left every layer's window."""

import pytest
import torch

from leanlm.config import EngineConfig, ModelConfig
from leanlm.engine import LLMEngine
from leanlm.model.llama import build_model
from leanlm.sampling_params import SamplingParams
from tests.conftest import run_to_completion
from tests.model.test_llama import _paged_logits

transformers = pytest.importorskip("transformers")

WINDOW = 8
COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
CASES = {
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW), (WINDOW,) * 3),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        (None, WINDOW, WINDOW),
    ),
    "alternating": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        (WINDOW, None, WINDOW),
    ),
}


def hf_pair(case: str):
    cls, cfg_cls, extra, windows = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**COMMON, **extra)).eval().double()
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert config.layer_windows == windows
    return hf, build_model(config, dict(hf.state_dict()), torch.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_windowed_layers_match_hf_at_four_windows(case):
    hf, ours = hf_pair(case)
    ids = torch.randint(0, 101, (4 * WINDOW,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    # a prompt chunk longer than the window, chunks straddling it, then decodes
    got = _paged_logits(ours, ids, [11, 5, 9, 1, 1, 1, 1, 1, 1, 1], list(range(8)))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    full = torch.nn.functional.softmax(ref, -1)[-1]
    assert (full - torch.nn.functional.softmax(_full_attention_logits(case, ids), -1)[-1]).abs().max() > 1e-6


def _full_attention_logits(case: str, ids: torch.Tensor) -> torch.Tensor:
    """The same weights with every window off: the test would not notice a window that does nothing."""
    cls, cfg_cls, extra, _ = CASES[case]
    hf, _ = hf_pair(case)
    plain = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**COMMON)).eval().double()
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        return plain(ids[None]).logits[0]


def test_saved_config_round_trips_the_windows():
    config = ModelConfig.from_hf_dict(hf_pair("qwen2")[0].config.to_dict())
    again = ModelConfig.from_hf_dict(config.to_hf_dict())
    assert again.layer_windows == config.layer_windows


def _engine(case: str, tokenizer, **options) -> LLMEngine:
    _, model = hf_pair(case)
    config = EngineConfig.from_options(block_size=4, max_num_batched_tokens=8, **options)
    return LLMEngine(model, tokenizer, config, torch.device("cpu"), torch.float64)


def test_blocks_in_use_stay_constant_once_the_window_fills(tokenizer):
    engine = _engine("mistral", tokenizer)
    engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=40, ignore_eos=True, temperature=0), "a")
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.unfinished_request_ids():
            held.append(engine.kv_cache_manager.num_held_blocks("a"))
    # Prefill: the window (8) + a chunk of up to 8 tokens in blocks of 4: at most 5 blocks. Decode: the window
    # and the new token span 3 blocks at most, from the first decode to the 59th token (15 blocks without a window)
    assert max(held[:3]) <= 5
    assert max(held[3:]) == 3 and min(held[3:]) >= 2 and len(held) > 35
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks  # nothing leaked


def test_windowed_engine_matches_hf_greedy(tokenizer):
    """Freed blocks (reused by nobody here) and the window together: greedy tokens equal HF's own generate."""
    hf, _ = hf_pair("mistral")
    engine = _engine("mistral", tokenizer)
    prompt = list(range(3, 30))
    engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0), "a")
    ours = run_to_completion(engine)["a"].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert list(ours) == ref


def test_a_model_with_a_full_layer_keeps_every_block(tokenizer):
    engine = _engine("alternating", tokenizer)
    assert engine.kv_cache_manager.retention is None
