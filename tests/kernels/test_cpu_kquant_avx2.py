"""The AVX2 K-quant GEMVs (gemv_kquant_avx2.c) with int8 activations: the super-block factors found exactly (and
refused where scales do not factor), both kernels against cpu_a8.reference at 1-64 rows, GGUF Q4_K and Q6_K
blocks through their layers, and the float32 decode loop running them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from leanlm.compress import RTNConfig, compress
from leanlm.formats.gguf.codes import runtime_linear
from leanlm.kernels import cpu_a8, cpu_decode, cpu_kquant_avx2
from leanlm.model.linear.act_quant import activation_quant, resolve_activation_quant
from leanlm.model.linear.int8 import Int8WeightOnlyLinear
from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
from leanlm.model.llama import build_model
from leanlm.model.quantized.numerics import pack_int4
from tests.conftest import tiny_state_dict
from tests.formats.gguf.test_codes import _random_blocks
from tests.kernels.test_cpu_decode import _cache, _config, _decode

needs_kernels = pytest.mark.skipif(not cpu_kquant_avx2.is_available(), reason="the K-quant GEMVs need AVX2")


def _q4_k_like(n: int, k: int, seed: int = 0):
    """Codes [N, K / 2] and scales, mins [N, K / 32] as llama.cpp's Q4_K quantizer leaves them: fp16 d and dmin
    per 256 times 6-bit integers, the largest of each super-block 63; and the float weight."""
    gen = torch.Generator().manual_seed(seed)
    s = k // 256
    d = (torch.rand(n, s, 1, generator=gen) * 0.01 + 1e-4).half().float()
    dmin = (torch.rand(n, s, 1, generator=gen) * 0.01).half().float()
    sc, mn = (torch.randint(0, 64, (n, s, 8), generator=gen) for _ in range(2))
    sc[..., 3], mn[..., 5] = 63, 63
    scales, mins = (d * sc).reshape(n, -1), -(dmin * mn).reshape(n, -1)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    w = (codes.float().view(n, -1, 32) * scales[..., None] + mins[..., None]).reshape(n, k)
    return pack_int4(codes), scales, mins, w


def _q6_k_like(n: int, k: int, seed: int = 0):
    """Codes -32..31 [N, K] and scales [N, K / 16] as Q6_K's: fp16 d per 256 times int8, one -128 per block."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.randn(n, k // 256, 1, generator=gen) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (n, k // 256, 16), generator=gen)
    sc[..., 7] = -128
    scales = (d * sc).reshape(n, -1)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
    return codes, scales, (codes.float().view(n, -1, 16) * scales[..., None]).reshape(n, k)


def test_factor_blocks_finds_the_factors_or_refuses():
    _, scales, mins, _ = _q4_k_like(6, 512)
    codes, d = cpu_kquant_avx2.factor_blocks(scales, 8, 0, 255, (63,))
    assert torch.equal(d.repeat_interleave(8, dim=1) * codes.float(), scales) and int(codes.max()) == 63
    codes, d = cpu_kquant_avx2.factor_blocks(mins, 8, 0, 255, (63,))
    assert (d <= 0).all() and torch.equal(d.repeat_interleave(8, dim=1) * codes.float(), mins)
    zero = torch.zeros(2, 16)  # an all-zero block is d = 0
    codes, d = cpu_kquant_avx2.factor_blocks(zero, 8, 0, 255, (63,))
    assert not codes.any() and not d.any()
    assert cpu_kquant_avx2.factor_blocks(torch.rand(4, 16) + 0.1, 8, 0, 255, (63,)) is None  # RTN-like scales
    assert cpu_kquant_avx2.factor_blocks(scales[:, :12], 8, 0, 255, (63,)) is None  # not whole blocks


@needs_kernels
def test_compact_copies_only_where_exact():
    qweight, scales, mins, _ = _q4_k_like(4, 512)
    assert cpu_kquant_avx2.super_scales(scales, mins) is not None
    assert cpu_kquant_avx2.super_scales(scales[:, :8], mins[:, :8]) is not None  # K = 256: one super-block
    assert cpu_kquant_avx2.super_scales(scales[:, :4], mins[:, :4]) is None  # K = 128: not one
    off = scales.clone()
    off[0, 1] *= 1 + 2**-20  # not the block's largest (group 3 is): d stays, this one is no multiple of it
    assert cpu_kquant_avx2.super_scales(off, mins) is None
    codes, s6, _ = _q6_k_like(4, 512)
    six = cpu_kquant_avx2.six_bit_copy(codes, s6)
    assert six is not None and six.ql.shape == (4, 256) and six.qh.shape == (4, 128) and six.sc.shape == (4, 32)
    wide = codes.clone()
    wide[0, 0] = 40  # outside 6 bits
    assert cpu_kquant_avx2.six_bit_copy(wide, s6) is None
    assert cpu_kquant_avx2.six_bit_copy(codes[:, :384], s6[:, :24]) is None  # K not whole super-blocks


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(40, 256), (100, 1536), (37, 2304)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 17, 64])
def test_kernels_match_the_reference(n, k, m):
    gen = torch.Generator().manual_seed(n + m)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    qweight, scales, mins, w4 = _q4_k_like(n, k, seed=n)
    got = cpu_kquant_avx2.linear_int4k_a8(x, qweight, cpu_kquant_avx2.super_scales(scales, mins), bias)
    torch.testing.assert_close(got, cpu_a8.reference(x, w4, bias), rtol=2e-5, atol=2e-5 * w4.abs().max().item())
    codes, s6, w6 = _q6_k_like(n, k, seed=n)
    got = cpu_kquant_avx2.linear_int6_a8(x, cpu_kquant_avx2.six_bit_copy(codes, s6), None)
    ref = cpu_a8.reference(x, w6, None)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


@needs_kernels
def test_a_wrong_tensor_is_a_clear_error():
    qweight, scales, mins, _ = _q4_k_like(8, 512)
    s = cpu_kquant_avx2.super_scales(scales, mins)
    with pytest.raises(ValueError, match="x must be a contiguous float32"):
        cpu_kquant_avx2.linear_int4k_a8(torch.randn(1, 512, dtype=torch.bfloat16), qweight, s)
    with pytest.raises(ValueError, match="x has shape"):
        cpu_kquant_avx2.linear_int4k_a8(torch.randn(1, 256), qweight, s)


def _gguf_layer(qtype: Q, rows: int, cols: int):
    """A layer from raw GGUF blocks, random but with each super-block's largest scale where llama.cpp puts it."""
    data = _random_blocks(qtype, rows, cols).reshape(rows, cols // 256, -1)
    if qtype == Q.Q4_K:
        data[..., 4] |= 0x3F  # group 0's 6-bit scale: 63
        data[..., 8] |= 0x3F  # group 0's 6-bit min: 63
    else:
        data[..., 192] = 0x80  # sub-block 0's int8 scale: -128
    return runtime_linear(qtype, np.ascontiguousarray(data.reshape(rows, -1)), (rows, cols))


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_gguf_k_quant_layers_run_on_them(qtype):
    layer = _gguf_layer(qtype, 48, 512)
    if qtype == Q.Q4_K:
        assert isinstance(layer, IntGroupWeightOnlyLinear)
        assert isinstance(layer._compact(), cpu_kquant_avx2.SuperScales)
    else:
        assert isinstance(layer, Int8WeightOnlyLinear) and layer.six_bit_weight() is not None
        # groups of 16: int8 activations only for float32 models (the one kernel that takes them is float32)
        assert layer.supports_act_quant(torch.float32) and not layer.supports_act_quant(torch.bfloat16)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    ref = cpu_a8.reference(x, layer.dequantized_weight(), layer.bias)
    with activation_quant("int8"):
        torch.testing.assert_close(layer(x), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
        assert layer.native_linear_f32().name == ("int4k_a8_f32" if qtype == Q.Q4_K else "int6_a8_f32")


def _k_quant_model():
    """A 2-layer float32 model whose int4 layers hold Q4_K-like scales and whose down projections are Q6_K-like."""
    cfg = dataclasses.replace(_config(), hidden_size=512, num_attention_heads=8, intermediate_size=768)
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    compress(model, [RTNConfig(bits=4, group_size=32)], None, progress=False)
    for i, layer in enumerate(model.model.layers):
        for name, module in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
            if not isinstance(module, IntGroupWeightOnlyLinear):
                continue
            parent = layer.mlp if name.endswith(("gate_proj", "up_proj", "down_proj")) else layer.self_attn
            n, k = module.out_features, module.in_features
            if name == "down_proj":
                codes, scales, _ = _q6_k_like(n, k, seed=i)
                setattr(parent, name, Int8WeightOnlyLinear(codes, scales * 2**-5, group_size=16))  # still exact
            else:
                qweight, scales, mins, _ = _q4_k_like(n, k, seed=i)
                scales, mins = scales * 2**-5, mins * 2**-5  # weights of ~0.05; a power of two keeps the factors
                setattr(
                    parent, name, IntGroupWeightOnlyLinear(qweight, scales, mins, module.bias, bits=4, group_size=32)
                )
    return model


@needs_kernels
@pytest.mark.skipif(not cpu_decode.is_available(torch.float32), reason="the float32 decode loop needs AVX2")
@pytest.mark.parametrize("batch", [1, 3])
def test_the_float32_loop_runs_them(batch):
    model = _k_quant_model()
    assert resolve_activation_quant(model, "int8") == ("int8", 2 * 7)
    blocks = max(64, 16 * batch)
    with activation_quant("int8"):
        plan = model.native_decode_plan()
        kinds = {linear.name for layer in plan.loop._keep[0] for linear in layer.linears}
        assert kinds == {"int4k_a8_f32", "int6_a8_f32"}
        native = _decode(model, True, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
        reference = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    float_path = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    # as test_cpu_decode_f32's int8 case: well within the int8 activations' own distance from float32 ones
    distance = ((native - reference).norm() / reference.norm()).item()
    quantization = ((reference - float_path).norm() / float_path.norm()).item()
    assert distance < 0.5 * quantization and quantization < 0.05, (distance, quantization)
