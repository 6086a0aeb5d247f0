"""The W4A8 / W8A8-dynamic VNNI kernel (gemm_a8.c) against its float reference (activations fake-quantized in
groups of 32, times the dequantized weight): int4 and int8 codes, per channel and in groups of 32-128, bias, padded
N, 1 to 40 rows; its activation codes exactly quantize_act_int8's; rows that do not depend on the batch or the
thread count; the packed layouts; refused arguments."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_a8
from leanlm.kernels.act_int8 import fake_quantize_act_int8, quantize_act_int8

pytestmark = pytest.mark.skipif(not cpu_a8.is_available(), reason=f"gemm_a8: {cpu_a8._KERNEL.unavailable_reason}")


def _weights(bits: int, N: int, K: int, group: int | None, has_bias: bool, seed: int = 0):
    """(packed, float64 weight [N, K], bias) for random codes of `bits` with `group` (None: per channel)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(N, generator=g).to(torch.bfloat16) if has_bias else None
    groups = 1 if group is None else K // group
    scales = torch.rand(N, groups, generator=g) / (60 * K**0.5)
    if bits == 8:
        q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        packed = cpu_a8.pack_int8(q, scales.reshape(N) if group is None else scales, group, bias)
        w = q.double().view(N, groups, -1) * scales.double()[..., None]
    else:
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        mins = torch.randn(N, groups, generator=g) / (10 * K**0.5)
        packed = cpu_a8.pack_int4(q, scales, mins, group, bias)
        w = q.double().view(N, groups, -1) * scales.double()[..., None] + mins.double()[..., None]
    return packed, w.reshape(N, K), bias


def _close_to_reference(y: torch.Tensor, x, w, bias) -> None:
    """y within one bf16 rounding (plus float32 summation noise) of the exact product of q(x) and w."""
    ref = fake_quantize_act_int8(x).double() @ w.t() + (0 if bias is None else bias.double())
    slack = (y.double() - ref).abs() - ref.abs() * 2.0**-8
    assert slack.max() <= 1e-5 * ref.abs().max(), float(slack.max())


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (8, 64), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("M,N,K", [(1, 96, 128), (5, 70, 256), (6, 32, 128), (13, 200, 384), (40, 33, 256)])
def test_equals_the_float_reference(bits, group, M, N, K):
    packed, w, bias = _weights(bits, N, K, group, has_bias=M % 2 == 1, seed=M)
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 3).to(torch.bfloat16)
    x[0, :32] *= 40  # one group with an outlier scale: groups are quantized apart
    _close_to_reference(cpu_a8.gemm(x, packed), x, w, bias)


def test_activation_codes_are_quantize_act_int8s():
    """With W = I (int8, scale 1) each output is one code times its group's scale, rounded once: the kernel's
    quantization is bit for bit quantize_act_int8's, all-zero and tiny groups included."""
    K = 128
    x = (torch.randn(7, K) * torch.logspace(-30, 3, 7)[:, None]).to(torch.bfloat16)
    x[2, 32:64] = 0
    packed = cpu_a8.pack_int8(torch.eye(K, dtype=torch.int8), torch.ones(K), None)
    codes, scales = quantize_act_int8(x)
    expected = (codes.float().view(7, -1, 32) * scales[..., None]).reshape(7, K).to(torch.bfloat16)
    assert torch.equal(cpu_a8.gemm(x, packed), expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_the_batch_or_threads(bits):
    packed, _, _ = _weights(bits, 160, 256, 64, has_bias=True, seed=2)
    x = torch.randn(29, 256).to(torch.bfloat16)
    batched = cpu_a8.gemm(x, packed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.cat([cpu_a8.gemm(x[i : i + 1], packed) for i in range(x.shape[0])])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, single)


def test_packed_layouts():
    """int8: panel p, quad kq, column c holds W[32p + c, 4kq .. 4kq + 3] + 128. int4: quad pair j, half h,
    column c', byte t holds q[16h + c', 8j + t] | q[16h + c', 8j + 4 + t] << 4. Scales: one row per weight group."""
    q8 = (torch.arange(40 * 64) % 251 - 125).to(torch.int8).view(40, 64)
    p8 = cpu_a8.pack_int8(q8, torch.arange(40.0), None)
    assert p8.data.shape == (2, 16, 32, 4) and p8.data[1, 3, 3].tolist() == [int(v) + 128 for v in q8[35, 12:16]]
    assert p8.scales.shape == (2, 1, 32) and p8.scales[1, 0, 3] == 35 and (p8.scales[1, :, 8:] == 0).all()
    assert p8.span == 2
    q4 = (torch.arange(32 * 64) % 16).to(torch.uint8).view(32, 64)
    p4 = cpu_a8.pack_int4(q4, torch.ones(32, 1), torch.arange(32.0)[:, None], 64)
    assert p4.data.shape == (1, 8, 2, 16, 4)
    c, j, t = 16 + 5, 3, 2
    assert int(p4.data[0, j, 1, 5, t]) == int(q4[c, 8 * j + t]) | int(q4[c, 8 * j + 4 + t]) << 4
    assert p4.mins.shape == (1, 1, 32) and p4.mins[0, 0, c] == c and p4.span == 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_a8.pack_int8(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4), None)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_a8.pack_int4(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 4), torch.ones(4, 4), 16)
    packed = cpu_a8.pack_int8(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), None)
    with pytest.raises(ValueError, match=r"bf16 CPU rows \[\.\.\., 64\]"):
        cpu_a8.gemm(torch.zeros(2, 32, dtype=torch.bfloat16), packed)
    assert not cpu_a8.shape_ok(100, None) and not cpu_a8.shape_ok(64, 16) and cpu_a8.shape_ok(64, 64)
