"""`act_quant="int8"` on the weight-only int layers (W4A8 / W8A8-dynamic): the layer's kernel path gives its float
reference path's result (fake-quantized x times the dequantized weight, act-order gathered first); which layers take
it (K and weight groups whole groups of 32; not Q6_K's groups of 16); refused modes; and the engine option, which
switches the layers and the native loop's calls."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress import RTNConfig, compress
from leanlm.config import EngineConfig
from leanlm.kernels import cpu_a8, cpu_qgemv_avx2, isa
from leanlm.kernels.act_int8 import fake_quantize_act_int8
from leanlm.model.linear.act_quant import activation_quant, current_activation_quant, resolve_activation_quant
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from leanlm.model.quantized.numerics import pack_int4
from tests.conftest import tiny_config, tiny_state_dict


def _int4_layer(N: int = 40, K: int = 128, group: int = 64, perm: bool = False) -> IntGroupWeightOnlyLinear:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales, mins = torch.rand(N, K // group, generator=g) / 50, torch.randn(N, K // group, generator=g) / 20
    order = torch.randperm(K, generator=g) if perm else None
    layer = IntGroupWeightOnlyLinear(pack_int4(q), scales, mins, torch.randn(N), bits=4, group_size=group, perm=order)
    return layer.set_compute_dtype(torch.bfloat16)


def _int8_layer(N: int = 40, K: int = 128, group: int | None = None) -> Int8WeightOnlyLinear:
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N if group is None else (N, K // group), generator=g) / 500
    return Int8WeightOnlyLinear(q, scales, group_size=group)


def _expected(layer, x: torch.Tensor) -> torch.Tensor:
    """q(x in stored column order) times the weight in stored order, in float64."""
    w = layer.dequantized_weight().double()
    perm = getattr(layer, "perm", None)
    xs, w = (x, w) if perm is None else (x[..., perm], w[:, perm])
    bias = 0 if layer.bias is None else layer.bias.double()
    return fake_quantize_act_int8(xs).double() @ w.t() + bias


LAYERS = [_int4_layer, lambda: _int4_layer(perm=True), _int8_layer, lambda: _int8_layer(group=32)]


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("rows", [1, 5, 12])
def test_kernel_and_reference_paths_agree(make, rows, monkeypatch):
    layer = make()
    x = (torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)) * 2).to(torch.bfloat16)
    expected = _expected(layer, x)
    with activation_quant("int8"):
        fast = layer(x)
        monkeypatch.setattr(cpu_a8, "is_available", lambda: False)  # a CPU without VNNI: the float reference path
        slow = layer(x)
    for y in (fast, slow):
        assert y.dtype is torch.bfloat16 and y.shape == (rows, layer.out_features)
        assert ((y.double() - expected).abs() - expected.abs() * 2.0**-8).max() <= 1e-5 * expected.abs().max()
    if cpu_a8._KERNEL.is_available():
        assert layer.act_packed.value is not None  # the fast path ran the kernel on its packed copy


def test_int8_activations_differ_from_bf16_ones_by_the_activation_rounding():
    layer = _int4_layer()
    x = torch.randn(3, layer.in_features).to(torch.bfloat16)
    bf16 = layer(x)
    with activation_quant("int8"):
        int8 = layer(x)
    assert not torch.equal(bf16, int8) and torch.equal(layer(x), bf16)  # the mode ends with its block
    assert (int8.float() - bf16.float()).abs().max() < 0.05 * bf16.float().abs().max()


def test_which_layers_take_it():
    cfg = tiny_config(97)
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    compress(model, [RTNConfig(bits=4, group_size=32)], None, progress=False)
    linears = [m for m in model.modules() if isinstance(m, IntGroupWeightOnlyLinear)]
    mode, on = resolve_activation_quant(model, "int8")
    assert mode == "int8" and on == sum(m.in_features % 32 == 0 for m in linears) > 0
    with activation_quant(mode):
        assert all(m.act_int8(torch.float32) == (m.in_features % 32 == 0) for m in linears)
        with activation_quant("none"):  # nested: the inner mode, then the outer one again
            assert not any(m.act_int8(torch.float32) for m in linears)
        assert current_activation_quant() == "int8"
    assert current_activation_quant() == "none" and not any(m.act_int8(torch.float32) for m in linears)
    assert resolve_activation_quant(model, "none") == ("none", 0)
    q6k_like = _int8_layer(K=128, group=32)
    q6k_like.group_size = 16  # groups of 16 (Q6_K): an act group would span two weight scales
    assert not q6k_like.supports_act_quant()
    with pytest.raises(ValueError, match="act_quant must be one of"):
        resolve_activation_quant(model, "int4")
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        with activation_quant("auto"):
            pass


def test_auto_takes_int8_where_our_kernels_run_the_layer(monkeypatch):
    cfg = tiny_config(97)
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    compress(model, [RTNConfig(bits=4, group_size=32)], None, progress=False)
    total = sum(isinstance(m, IntGroupWeightOnlyLinear) for m in model.modules())
    # a float32 model: int8 activations where float32 is the fast dtype (the AVX2 level) and the W4A8 GEMV runs
    at_avx2 = isa.active_level() == "avx2" and cpu_qgemv_avx2.act_int8_is_available()
    assert resolve_activation_quant(model, "auto")[1] == (total if at_avx2 else 0)
    model.to(torch.bfloat16)
    assert resolve_activation_quant(model, "auto")[1] == (total if cpu_a8.is_available() else 0)
    monkeypatch.setattr(cpu_a8, "is_available", lambda: False)  # no VNNI: the float reference would only cost time
    assert resolve_activation_quant(model, "auto") == ("none", 0)
    assert resolve_activation_quant(model, "int8") == ("int8", total)  # asked for: the reference path runs it


def test_engine_option_is_validated():
    assert EngineConfig(act_quant="int8").act_quant == "int8"
    with pytest.raises(ValueError, match="act_quant must be one of none, int8"):
        EngineConfig(act_quant="fp8")


@pytest.mark.real_model
def test_smollm2_int8_activations_cost_little_and_the_loop_agrees(smollm_path):
    """The bundled Q4_1 file (Q4_1 linears, Q8_0 head) with int8 activations: every linear and the head take them,
    the KL to 16/32-bit activations on WikiText-2 stays small (0.005 nats measured on 16 windows of 512), and
    greedy decode gives the same tokens on the native loop and on the per-layer path. The bf16 loop computes
    what the per-layer path does bit for bit; the float32 one (the AVX2 level) to fp32 rounding, which moves an
    input across an int8 rounding boundary now and then: there the first tokens agree (later ones may part at a
    near tie, as on two machines: tests/kernels/test_cpu_decode_f32.py bounds the distance)."""
    from leanlm import LLM, SamplingParams
    from leanlm.analysis.eval import kl_divergence, make_windows, read_text
    from leanlm.data import wikitext2_test_path

    base = LLM(str(smollm_path), enable_prefix_caching=False, progress=False, act_quant="none")
    llm = LLM(str(smollm_path), enable_prefix_caching=False, progress=False, act_quant="int8")
    runner = llm.llm_engine.model_runner
    assert runner.act_quant_layers == 211  # 30 layers x 7 linears, and the head
    ids = llm.get_tokenizer().encode(read_text(wikitext2_test_path()))
    r = kl_divergence(base, llm, make_windows(ids, 128, max_windows=1), use_tqdm=False)
    assert 0 < r.mean_kl < 0.02 and r.top1_agreement > 0.9
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The history of the Roman Empire", "def fibonacci(n):"]
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner.model.allow_native_decode = False
    per_layer = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner.model.allow_native_decode = True
    if runner.model.model.norm.weight.dtype is torch.bfloat16:
        assert native == per_layer
    else:
        assert [t[:2] for t in native] == [t[:2] for t in per_layer]
