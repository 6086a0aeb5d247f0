"""The int8 (per channel and group-wise) / int4 weight-only small-M linear kernels: float64 references on the
dequantized weight within bf16 output rounding (random and adversarial inputs, every supported group size,
partial tiles and K blocks, M = 1..8 and several passes), thread-count invariance, argument checks and the
should_use policy."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_qgemv
from tests.kernels.linear_inputs import check_against_float64

pytestmark = pytest.mark.skipif(
    not cpu_qgemv.is_available(), reason=f"CPU quantized GEMV kernels: {cpu_qgemv.unavailable_reason()}"
)


def _x(M: int, K: int, g: torch.Generator, outlier: float | None = None) -> torch.Tensor:
    x = torch.randn(M, K, generator=g)
    if outlier is not None:  # one huge activation per row, as in LLM "massive activations"
        cols = torch.randint(0, K, (M,), generator=g)
        x[torch.arange(M), cols] = outlier
    return x.to(torch.bfloat16)


def _bias(N: int, has_bias: bool, g: torch.Generator):
    return torch.randn(N, generator=g).to(torch.bfloat16) if has_bias else None


def _int8_weight(N: int, K: int, g: torch.Generator):
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g) * 0.02 + 1e-3
    return qweight, scales


def _int4_weight(N: int, K: int, group_size: int, g: torch.Generator, bits: int = 4):
    codes = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    G = K // group_size
    scales = torch.rand(N, G, generator=g) * 0.05 + 1e-3
    zeros = torch.randint(0, 2**bits, (N, G), generator=g).float()
    mins = -zeros * scales  # asymmetric zero points
    return codes, qweight, scales, mins


def _dequant_int4(codes, scales, mins, group_size):
    return codes.double() * scales.double().repeat_interleave(group_size, 1) + mins.double().repeat_interleave(
        group_size, 1
    )


INT8_SHAPES = [(M, N, K) for M in (1, 2, 3, 4, 8) for N, K in ((576, 576), (37, 100), (7, 1536), (192, 33))] + [
    (5, 100, 64),
    (6, 33, 31),
    (7, 50, 96),
    (11, 200, 96),
    (17, 40, 576),
    (1, 49152, 576),
]


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K"), INT8_SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in INT8_SHAPES])
def test_int8_matches_float64(M, N, K, has_bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x, (qweight, scales), bias = _x(M, K, g), _int8_weight(N, K, g), _bias(N, has_bias, g)
    w_deq = qweight.double() * scales.double()[:, None]
    check_against_float64(cpu_qgemv.linear_int8(x, qweight, scales, bias), x, w_deq, bias, w_deq.abs())


INT8_GROUP_CASES = [
    (M, N, K, gs) for M in (1, 2, 3, 4, 8) for N, K, gs in ((576, 576, 32), (37, 1536, 64), (192, 96, 96))
] + [(5, 33, 576, 32), (6, 40, 64, 32), (7, 17, 256, 128), (11, 100, 192, 32), (1, 49152, 576, 32)]
INT8_GROUP_CASES += [(M, N, K, 16) for M in (1, 3, 8, 10) for N, K in ((576, 576), (37, 96), (896, 4864))]


def _int8_group_weight(N: int, K: int, gs: int, g: torch.Generator):
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, K // gs, generator=g) * 0.02 + 1e-3  # [N, G]
    return qweight, scales, qweight.double() * scales.double().repeat_interleave(gs, 1)


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    ("M", "N", "K", "gs"), INT8_GROUP_CASES, ids=[f"M{m}-N{n}-K{k}-g{gs}" for m, n, k, gs in INT8_GROUP_CASES]
)
def test_int8_group_wise_matches_float64(M, N, K, gs, has_bias):
    # GGUF Q8_0 / Q5_0: one scale per 32 (or gs) input columns.
    g = torch.Generator().manual_seed(M * 1000 + N + K + gs)
    x, bias = _x(M, K, g), _bias(N, has_bias, g)
    qweight, scales, w_deq = _int8_group_weight(N, K, gs, g)
    check_against_float64(cpu_qgemv.linear_int8(x, qweight, scales, bias, group_size=gs), x, w_deq, bias, w_deq.abs())


@pytest.mark.parametrize("gs", [16, 32, 64])
def test_int8_group_scales_sit_on_their_groups_exactly(gs):
    # Power-of-two scales and small integers: every product and sum is exact, so the output is too; a scale
    # applied to the wrong group would change it.
    g = torch.Generator().manual_seed(9)
    N, K = 40, 128
    qweight = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    scales = torch.exp2(torch.randint(-3, 4, (N, K // gs), generator=g).float())
    x = torch.randint(-4, 5, (3, K), generator=g).to(torch.bfloat16)
    expected = x.double() @ (qweight.double() * scales.double().repeat_interleave(gs, 1)).T
    y = cpu_qgemv.linear_int8(x, qweight, scales, group_size=gs)
    assert torch.equal(y, expected.to(torch.bfloat16))


INT4_CASES = [
    (M, N, K, gs)
    for M in (1, 2, 4, 8)
    for N, K, gs in ((576, 576, 64), (37, 1536, 128), (7, 1536, 256), (192, 576, 32), (33, 96, 96), (40, 320, 64))
] + [
    (3, 100, 256, 256),
    (5, 64, 576, 576),
    (6, 50, 160, 32),
    (7, 24, 384, 128),
    (11, 200, 256, 64),
    (17, 40, 1536, 32),
    (1, 49152, 576, 64),
    (3, 9, 32, 32),
    (2, 1536, 2048, 128),
]


def _check_int4(x, codes, qweight, scales, mins, gs, bias):
    w_deq = _dequant_int4(codes, scales, mins, gs)
    # The kernel sums x (128 + q) per group, then adds (min - 128 scale) * sum(x): slack for both terms.
    slack_w = (codes.double() + 128) * scales.double().repeat_interleave(gs, 1)
    slack_w = slack_w + (mins.double() - 128 * scales.double()).abs().repeat_interleave(gs, 1)
    check_against_float64(cpu_qgemv.linear_int4(x, qweight, scales, mins, gs, bias), x, w_deq, bias, slack_w)


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K", "gs"), INT4_CASES, ids=[f"M{m}-N{n}-K{k}-g{gs}" for m, n, k, gs in INT4_CASES])
def test_int4_matches_float64(M, N, K, gs, has_bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K + gs)
    x, bias = _x(M, K, g), _bias(N, has_bias, g)
    codes, qweight, scales, mins = _int4_weight(N, K, gs, g)
    _check_int4(x, codes, qweight, scales, mins, gs, bias)


@pytest.mark.parametrize("outlier", [300.0, -1e4, 3e5])
def test_huge_outlier_activation(outlier):
    g = torch.Generator().manual_seed(7)
    x = _x(4, 1536, g, outlier=outlier)
    qweight, scales = _int8_weight(96, 1536, g)
    w_deq = qweight.double() * scales.double()[:, None]
    check_against_float64(cpu_qgemv.linear_int8(x, qweight, scales), x, w_deq, None, w_deq.abs())
    for gs in (32, 128):
        codes, qweight4, scales4, mins4 = _int4_weight(96, 1536, gs, g)
        _check_int4(x, codes, qweight4, scales4, mins4, gs, None)


def test_int4_three_bit_codes_and_symmetric_zero():
    g = torch.Generator().manual_seed(3)
    x = _x(3, 512, g)
    codes, qweight, scales, mins = _int4_weight(64, 512, 64, g, bits=3)
    _check_int4(x, codes, qweight, scales, mins, 64, None)
    _check_int4(x, codes, qweight, scales, torch.full_like(scales, 0.0) - 4 * scales, 64, None)


def test_nibble_order_and_scale_placement_exactly():
    # Small integers and halves: every product and fp32 sum is exact, so the kernel must equal the exact
    # result rounded once to bf16 (a wrong nibble order or group scale would move these sums).
    K, gs = 320, 32
    x = torch.zeros(2, K, dtype=torch.bfloat16)
    x[0, 5], x[0, 130], x[1, 319] = 1.0, 2.0, -1.0
    codes = torch.arange(K, dtype=torch.int64).remainder(16).to(torch.uint8).repeat(3, 1)
    qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scales = torch.arange(1, 3 * K // gs + 1, dtype=torch.float32).reshape(3, K // gs)
    mins = torch.full_like(scales, 0.5)
    y = cpu_qgemv.linear_int4(x, qweight, scales, mins, gs)
    expected = x.double() @ _dequant_int4(codes, scales, mins, gs).T
    assert torch.equal(y, expected.float().to(torch.bfloat16)), (y, expected)


@pytest.mark.parametrize(("M", "N", "K"), [(3, 1536, 576), (9, 40, 4096), (1, 33, 8192)])
def test_thread_count_does_not_change_results(M, N, K):
    # (40, 4096) and (33, 8192) are big enough to split, into a full 32-row block and a partial one.
    g = torch.Generator().manual_seed(1)
    x, bias = _x(M, K, g), _bias(N, True, g)
    qweight, scales = _int8_weight(N, K, g)
    _, qweight4, scales4, mins4 = _int4_weight(N, K, 64, g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(
                (
                    cpu_qgemv.linear_int8(x, qweight, scales, bias),
                    cpu_qgemv.linear_int4(x, qweight4, scales4, mins4, 64, bias),
                    cpu_qgemv.linear_int8(x, qweight, scales4.contiguous(), bias, group_size=64),
                )
            )
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_leading_dims_and_rows_beyond_one_pass():
    g = torch.Generator().manual_seed(2)
    x = _x(10, 256, g)
    qweight, scales = _int8_weight(70, 256, g)
    _, qweight4, scales4, mins4 = _int4_weight(70, 256, 128, g)
    y8 = cpu_qgemv.linear_int8(x, qweight, scales)
    y4 = cpu_qgemv.linear_int4(x, qweight4, scales4, mins4, 128)
    x3 = x.reshape(2, 5, 256)
    assert torch.equal(cpu_qgemv.linear_int8(x3, qweight, scales), y8.reshape(2, 5, 70))
    assert torch.equal(cpu_qgemv.linear_int4(x3, qweight4, scales4, mins4, 128), y4.reshape(2, 5, 70))
    assert torch.equal(cpu_qgemv.linear_int8(x[3], qweight, scales), y8[3])  # 1-D x
    assert torch.equal(cpu_qgemv.linear_int4(x[3], qweight4, scales4, mins4, 128), y4[3])
    # Rows are independent: row 9 (second pass) equals computing it alone.
    assert torch.equal(cpu_qgemv.linear_int8(x[9:], qweight, scales), y8[9:])
    assert torch.equal(cpu_qgemv.linear_int4(x[9:], qweight4, scales4, mins4, 128), y4[9:])


def test_empty_k_gives_the_bias():
    bias = torch.arange(3, dtype=torch.bfloat16)
    x = torch.zeros(2, 0, dtype=torch.bfloat16)
    assert torch.equal(
        cpu_qgemv.linear_int8(x, torch.zeros(3, 0, dtype=torch.int8), torch.ones(3), bias), bias.expand(2, 3)
    )


def test_int8_rejects_what_it_cannot_read():
    g = torch.Generator().manual_seed(4)
    x, bias = _x(2, 128, g), _bias(64, True, g)
    qweight, scales = _int8_weight(64, 128, g)
    with pytest.raises(ValueError, match="does not match"):
        cpu_qgemv.linear_int8(x[:, :100].contiguous(), qweight, scales)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_qgemv.linear_int8(x.t().contiguous().t(), qweight, scales)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_qgemv.linear_int8(x.float(), qweight, scales)
    with pytest.raises(ValueError, match="int8"):
        cpu_qgemv.linear_int8(x, qweight.to(torch.uint8), scales)
    with pytest.raises(ValueError, match="qweight"):
        cpu_qgemv.linear_int8(x, qweight[:, ::2], scales)
    with pytest.raises(ValueError, match="scales must be a contiguous float32"):
        cpu_qgemv.linear_int8(x, qweight, scales.to(torch.bfloat16))
    with pytest.raises(ValueError, match="scales has shape"):
        cpu_qgemv.linear_int8(x, qweight, scales[:10])
    with pytest.raises(ValueError, match="bias"):
        cpu_qgemv.linear_int8(x, qweight, scales, bias[:10])
    grouped = torch.rand(64, 4)
    with pytest.raises(ValueError, match="group_size"):
        cpu_qgemv.linear_int8(x, qweight, grouped, group_size=48)  # neither 16 nor a multiple of 32
    with pytest.raises(ValueError, match="group_size"):
        cpu_qgemv.linear_int8(x, qweight, grouped, group_size=96)  # does not divide K = 128
    with pytest.raises(ValueError, match="scales has shape"):
        cpu_qgemv.linear_int8(x, qweight, grouped, group_size=64)  # scales made for group size 32
    with pytest.raises(ValueError, match="scales has shape"):
        cpu_qgemv.linear_int8(x, qweight, scales, group_size=32)  # per-channel scales


def test_int4_rejects_what_it_cannot_read():
    g = torch.Generator().manual_seed(5)
    x = _x(2, 256, g)
    _, qweight, scales, mins = _int4_weight(64, 256, 64, g)
    with pytest.raises(ValueError, match="does not match"):
        cpu_qgemv.linear_int4(x[:, :128].contiguous(), qweight, scales, mins, 64)
    with pytest.raises(ValueError, match="uint8"):
        cpu_qgemv.linear_int4(x, qweight.to(torch.int8), scales, mins, 64)
    with pytest.raises(ValueError, match="group_size"):
        cpu_qgemv.linear_int4(x, qweight, scales, mins, 48)
    with pytest.raises(ValueError, match="group_size"):
        cpu_qgemv.linear_int4(x, qweight, scales, mins, 96)  # does not divide K = 256
    with pytest.raises(ValueError, match="scales has shape"):
        cpu_qgemv.linear_int4(x, qweight, scales, mins, 128)  # scales made for group size 64
    with pytest.raises(ValueError, match="mins has shape"):
        cpu_qgemv.linear_int4(x, qweight, scales, mins[:, :2].contiguous(), 64)
    with pytest.raises(ValueError, match="mins must be a contiguous float32"):
        cpu_qgemv.linear_int4(x, qweight, scales, mins.t().contiguous().t(), 64)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_qgemv.linear_int4(x.half(), qweight, scales, mins, 64)


def test_should_use_policy():
    g = torch.Generator().manual_seed(6)
    x = _x(4, 256, g)
    qweight, _ = _int8_weight(64, 256, g)
    _, qweight4, _, _ = _int4_weight(64, 256, 64, g)
    assert cpu_qgemv.should_use_int8(x, qweight) and cpu_qgemv.should_use_int8(x[:1], qweight)
    assert cpu_qgemv.should_use_int8(torch.zeros(2, 4, 256, dtype=torch.bfloat16), qweight)  # 8 rows
    assert cpu_qgemv.should_use_int8(torch.zeros(64, 256, dtype=torch.bfloat16), qweight)  # several passes
    assert not cpu_qgemv.should_use_int8(torch.zeros(65, 256, dtype=torch.bfloat16), qweight)  # M > MAX_ROWS
    assert not cpu_qgemv.should_use_int8(x.float(), qweight)
    assert not cpu_qgemv.should_use_int8(x.t().contiguous().t(), qweight)
    assert not cpu_qgemv.should_use_int8(x, qweight.t().contiguous().t())
    assert not cpu_qgemv.should_use_int8(x[:, :128].contiguous(), qweight)
    assert not cpu_qgemv.should_use_int8(x, qweight4)  # uint8 is the int4 layout
    assert cpu_qgemv.should_use_int8(x, qweight, 32) and cpu_qgemv.should_use_int8(x, qweight, 256)
    assert cpu_qgemv.should_use_int8(x, qweight, 16) and not cpu_qgemv.should_use_int8(x, qweight, 8)
    assert not cpu_qgemv.should_use_int8(x, qweight, 48) and not cpu_qgemv.should_use_int8(x, qweight, 96)
    for gs in (32, 64, 128, 256):
        assert cpu_qgemv.should_use_int4(x, qweight4, gs)
    assert not cpu_qgemv.should_use_int4(x, qweight4, 48)  # not a multiple of 32
    assert not cpu_qgemv.should_use_int4(x, qweight4, 96)  # does not divide K
    assert not cpu_qgemv.should_use_int4(x, qweight4, 512)
    assert not cpu_qgemv.should_use_int4(torch.zeros(65, 256, dtype=torch.bfloat16), qweight4, 64)
    assert not cpu_qgemv.should_use_int4(x, qweight, 64)  # int8 weight
    assert not cpu_qgemv.should_use_int4(x[:, :128].contiguous(), qweight4, 64)


def test_concurrent_callers_get_their_own_scratch():
    # ctypes drops the GIL: Python threads run the kernel at once, each with its own permuted-x scratch.
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(8)
    _, qweight, scales, mins = _int4_weight(256, 1536, 64, g)
    xs = [_x(1 + i % 8, 1536, g) for i in range(16)]
    serial = [cpu_qgemv.linear_int4(x, qweight, scales, mins, 64) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            parallel = list(pool.map(lambda x: cpu_qgemv.linear_int4(x, qweight, scales, mins, 64), xs))
            assert all(torch.equal(a, b) for a, b in zip(serial, parallel))


@pytest.mark.parametrize("N,K,gs", [(64, 256, 64), (40, 96, 32), (7, 512, 256)])
def test_dequantize_to_bf16_equals_the_reference_rounded_once(N, K, gs):
    g = torch.Generator().manual_seed(7)
    qweight, scales = _int8_weight(N, K, g)
    ref = (qweight.float() * scales[:, None]).to(torch.bfloat16)
    assert torch.equal(cpu_qgemv.dequantize_int8(qweight, scales), ref)
    for group in sorted({gs, 16}) if K % 32 == 0 else ():  # group-wise int8 (Q6_K: 16)
        qg, sg, _ = _int8_group_weight(N, K, group, g)
        refg = (qg.float().view(N, K // group, group) * sg[..., None]).reshape(N, K).to(torch.bfloat16)
        assert torch.equal(cpu_qgemv.dequantize_int8(qg, sg, group), refg)
    codes, packed, scales4, mins4 = _int4_weight(N, K, gs, g)
    ref4 = (codes.float().view(N, K // gs, gs) * scales4[..., None] + mins4[..., None]).reshape(N, K)
    assert torch.equal(cpu_qgemv.dequantize_int4(packed, scales4, mins4, gs), ref4.to(torch.bfloat16))
    with pytest.raises(ValueError, match="divid"):
        cpu_qgemv.dequantize_int4(packed, scales4, mins4, 5)
    with pytest.raises(ValueError, match="int8"):
        cpu_qgemv.dequantize_int8(packed, scales)
