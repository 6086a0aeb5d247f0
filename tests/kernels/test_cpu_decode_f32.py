"""The float32 native decode loop (decode_layers_f32.c, the AVX2 level) against the PyTorch path it replaces: hidden
states over several decode steps within fp32 rounding, for int4 layers (groups of 32 and 64, act-order, q/k/v
biases) with float32 and int8 activations, batch 1, 3 and 8; 17 rows (each product in two calls of its 16-row
kernel); when it steps aside (a bf16 cache, more than 64 rows); and greedy SmolLM2 output unchanged by it."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress import RTNConfig, compress
from leanlm.kernels import cpu_decode, cpu_qgemv_avx2
from leanlm.model.linear.act_quant import activation_quant
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from tests.conftest import tiny_state_dict
from tests.kernels.test_cpu_decode import _cache, _config, _decode

pytestmark = pytest.mark.skipif(
    not cpu_decode.is_available(torch.float32), reason="the float32 decode loop needs the AVX2 level"
)


def _model(group: int = 64, perm: bool = False, architecture: str = "llama"):
    cfg = _config(architecture)
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    compress(model, [RTNConfig(bits=4, group_size=group)], None, progress=False)
    if perm:
        gen = torch.Generator().manual_seed(5)
        for module in model.modules():
            if isinstance(module, IntGroupWeightOnlyLinear):
                module.perm = torch.randperm(module.in_features, generator=gen)
    return model


@pytest.mark.parametrize(
    ("group", "perm", "act_int8", "architecture"),
    [
        (64, False, False, "llama"),
        (32, False, True, "llama"),
        (64, False, True, "llama"),
        (64, True, False, "llama"),
        (64, True, True, "llama"),
        (32, False, False, "qwen2"),  # q/k/v biases
    ],
)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_loop_matches_the_pytorch_path(group, perm, act_int8, architecture, batch):
    model = _model(group, perm, architecture)
    with activation_quant("int8" if act_int8 else "none"):  # as the engine runs each step
        plan = model.native_decode_plan()
        assert plan.loop is not None and plan.loop.dtype is torch.float32
        cache = _cache(model, torch.float32, num_blocks=max(64, 16 * batch))
        native = _decode(model, True, batch, cache=cache)
        reference = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=max(64, 16 * batch)))
    if not act_int8:
        torch.testing.assert_close(native, reference, rtol=2e-4, atol=2e-4)
        return
    # int8 activations: fp32 differences in the ops between products (RMSNorm, softmax: other summation orders) can
    # move an input across a rounding boundary, one code apart, and the model carries that on (the PyTorch path on
    # embeddings changed by one part in 1e6 moves as far). So: well within the int8 activations' own distance from
    # float32 ones (1.5e-2 here; a wrong scale or order would be far beyond it), not equal.
    float_path = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=max(64, 16 * batch)))
    distance = ((native - reference).norm() / reference.norm()).item()
    quantization = ((reference - float_path).norm() / float_path.norm()).item()
    assert distance < 0.5 * quantization and quantization < 0.05, (distance, quantization)


@pytest.mark.parametrize("batch", [1, 8])
def test_blocks_of_16_keys_take_the_eight_key_score_path_and_match(batch, monkeypatch):
    """BLOCK is 4 above, so every block's scores come one key at a time; in blocks of 16 (the engine's default) the
    attention scores 8 keys at once (qk_rows) and walks full and partial blocks."""
    from tests.kernels import test_cpu_decode

    monkeypatch.setattr(test_cpu_decode, "BLOCK", 16)
    model = _model(64)
    native = _decode(model, True, batch, cache=_cache(model, torch.float32, num_blocks=16 * batch))
    reference = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=16 * batch))
    torch.testing.assert_close(native, reference, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_an_int8_kv_cache_matches_the_pytorch_path_on_it(batch, block, monkeypatch):
    """kv_cache_dtype int8 (a scale per token and KV head): the loop quantizes K/V as kv_quant does and attends over
    codes times scales. A K/V value at a rounding boundary may land one code apart (fp32 differences before the
    write), so: far closer to the PyTorch path on the same cache than that path is to a float32 cache."""
    from tests.kernels import test_cpu_decode

    monkeypatch.setattr(test_cpu_decode, "BLOCK", block)
    model = _model(64)
    blocks = max(64, 16 * batch)
    native = _decode(model, True, batch, cache=_cache(model, torch.int8, num_blocks=blocks))
    reference = _decode(model, False, batch, cache=_cache(model, torch.int8, num_blocks=blocks))
    float_cache = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    distance = ((native - reference).norm() / reference.norm()).item()
    quantization = ((reference - float_cache).norm() / float_cache.norm()).item()
    assert distance < 0.1 * quantization and quantization < 0.05, (distance, quantization)


def test_it_steps_aside_where_it_does_not_apply(monkeypatch):
    from tests.kernels import test_cpu_decode

    monkeypatch.setattr(test_cpu_decode, "BLOCK", 16)  # room for the longest of 65 prompts in 16 blocks
    model = _model()
    assert not model.native_decode_plan().accepts(_cache(model, torch.bfloat16))  # float32 or int8 caches only
    assert not model.native_decode_plan().accepts(_cache(model, torch.float8_e4m3fn))
    assert model.native_decode_plan().loop.max_rows == cpu_decode.F32_MAX_ROWS
    rows = cpu_qgemv_avx2.MAX_ROWS + 1  # past the int4 GEMV's 16 rows: each product in two calls of the kernel
    native = _decode(model, True, rows, steps=2, cache=_cache(model, torch.float32, num_blocks=16 * rows))
    reference = _decode(model, False, rows, steps=2, cache=_cache(model, torch.float32, num_blocks=16 * rows))
    torch.testing.assert_close(native, reference, rtol=2e-4, atol=2e-4)
    assert not torch.equal(native, reference)  # (the loop ran: its sums differ from torch's in the last bits)
    rows = cpu_decode.F32_MAX_ROWS + 1  # one row more than the loop takes: the PyTorch path runs them
    native = _decode(model, True, rows, steps=2, cache=_cache(model, torch.float32, num_blocks=16 * rows))
    reference = _decode(model, False, rows, steps=2, cache=_cache(model, torch.float32, num_blocks=16 * rows))
    torch.testing.assert_close(native, reference, rtol=0, atol=0)
    cfg = _config()
    loop = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.bfloat16).native_decode_plan().loop
    assert loop is None or loop.dtype is torch.bfloat16  # a bf16 model never runs the float32 loop


@pytest.mark.real_model
def test_smollm2_greedy_tokens_are_the_same_on_the_loop():
    """float32 activations: the same tokens. (With int8 ones a code flip at a near tie may change a later token,
    as on any two machines: the kernel tests above bound that.)"""
    from leanlm import LLM, SamplingParams

    llm = LLM(dtype="float32", act_quant="none", enable_prefix_caching=False, progress=False)
    model = llm.llm_engine.model_runner.model
    assert model.native_decode_plan().loop.dtype is torch.float32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The history of the Roman Empire", "def fibonacci(n):"]
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model.allow_native_decode = False
    per_layer = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert native == per_layer
