"""The 2:4 kernels with int8 and 4-bit kept weights (gemv_sparse24_quant.c): float64 math on the dequantized
weight within bf16 output rounding, for per-channel and group-wise scales, zero codes anywhere in 0-15 (the
pruned columns' fill), M = 1..8 and several passes, thread-count invariance, leading dims; the chunk layout of
the 4-bit codes exactly; argument checks and the should_use policy."""

from __future__ import annotations

import pytest
import torch

from leanlm.kernels import cpu_sparse
from leanlm.model.linear.sparse24 import compress_24
from leanlm.model.linear.sparse24_quant import pack_chunks, unpack_chunks, widen
from tests.kernels.linear_inputs import check_against_float64

pytestmark = pytest.mark.skipif(
    not cpu_sparse.quant_is_available(), reason=f"CPU 2:4 quantized kernels: {cpu_sparse.unavailable_reason()}"
)


def _mask(N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [N, K] bool with 2 of every 4 columns at random, its 2:4 bitmask [N, K / 8])."""
    keep = (torch.rand(N, K // 4, 4, generator=g).argsort(-1) < 2).reshape(N, K)
    _, mask = compress_24(keep.float())
    return keep, mask


def _int8(N: int, K: int, gs: int, g: torch.Generator):
    """(codes int8 [N, K / 2], mask, scales [N, K / gs], dense dequantized weight float64 [N, K])."""
    keep, mask = _mask(N, K, g)
    kept = torch.randint(-128, 128, (N, K // 2), generator=g, dtype=torch.int8)
    scales = torch.rand(N, K // gs, generator=g) * 0.02 + 1e-3
    dense = widen(kept, mask, torch.zeros(N, K, dtype=torch.int8))
    return kept, mask, scales, dense.double() * scales.double().repeat_interleave(gs, 1)


def _int4(N: int, K: int, gs: int, g: torch.Generator):
    """(chunked codes uint8 [N, K / 4], mask, scales, zeros uint8 [N, K / gs], dequantized float64 [N, K],
    the kernel's slack weight: |128 + code| * scale plus |min - 128 scale| per column)."""
    keep, mask = _mask(N, K, g)
    kept = torch.randint(0, 16, (N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, K // gs, generator=g) * 0.05 + 1e-3
    zeros = torch.randint(0, 16, (N, K // gs), generator=g, dtype=torch.uint8)
    s, z = scales.double().repeat_interleave(gs, 1), zeros.double().repeat_interleave(gs, 1)
    codes = widen(kept, mask, zeros.repeat_interleave(gs, 1)).double()
    w = torch.where(keep, codes * s - z * s, 0.0)
    slack = (codes + 128) * s + (z * s + 128 * s)
    return pack_chunks(kept), mask, scales, zeros, w, slack


CASES = [(M, N, K, gs) for M in range(1, 9) for N, K, gs in ((576, 576, 64), (37, 1536, 128), (33, 128, 128))]
CASES += [(M, 100, 640, gs) for M in (1, 3) for gs in (64, 320, 640)]  # K = gs: one scale per row
CASES += [(11, 40, 576, 64), (17, 64, 192, 64), (1, 1536, 576, 64), (2, 576, 1536, 64)]  # passes; threaded


def _inputs(M, N, K, gs, has_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    bias = torch.randn(N, generator=g).to(torch.bfloat16) if has_bias else None
    return g, x, bias


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K", "gs"), CASES, ids=[f"M{m}-N{n}-K{k}-g{gs}" for m, n, k, gs in CASES])
def test_int8_matches_float64(M, N, K, gs, has_bias):
    g, x, bias = _inputs(M, N, K, gs, has_bias, seed=M * 1000 + N + K + gs)
    codes, mask, scales, w = _int8(N, K, gs, g)
    y = cpu_sparse.linear_sparse24_quant(x, codes, mask, scales, None, bias, 8, gs)
    check_against_float64(y, x, w, bias, w.abs())


@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("M", "N", "K", "gs"), CASES, ids=[f"M{m}-N{n}-K{k}-g{gs}" for m, n, k, gs in CASES])
def test_int4_matches_float64(M, N, K, gs, has_bias):
    g, x, bias = _inputs(M, N, K, gs, has_bias, seed=M * 1000 + N + K + gs)
    codes, mask, scales, zeros, w, slack = _int4(N, K, gs, g)
    y = cpu_sparse.linear_sparse24_quant(x, codes, mask, scales, zeros, bias, 4, gs)
    check_against_float64(y, x, w, bias, slack)


def test_pruned_columns_add_nothing_whatever_x_holds_there():
    """Huge inputs on row 0's pruned columns: int8 adds exact zeros there (row 0's output keeps its bits); int4
    carries the zero code there and removes it with the group sums of x, so the result stays within the kernel's
    fp32 slack (the same as the dense int4 kernel's on those codes)."""
    g = torch.Generator().manual_seed(3)
    N, K, gs = 64, 256, 64
    x = torch.randn(1, K, generator=g).to(torch.bfloat16)
    codes, mask, scales, w = _int8(N, K, gs, g)
    loud = x.clone()
    loud[0, w[0] == 0] = 1e4
    y, y_loud = (cpu_sparse.linear_sparse24_quant(v, codes, mask, scales, None, None, 8, gs) for v in (x, loud))
    assert torch.equal(y[0, 0], y_loud[0, 0]) and not torch.equal(y[0, 1:], y_loud[0, 1:])
    codes, mask, scales, zeros, w, slack = _int4(N, K, gs, g)
    loud = x.clone()
    loud[0, w[0] == 0] = 1e4
    y_loud = cpu_sparse.linear_sparse24_quant(loud, codes, mask, scales, zeros, None, 4, gs)
    ref = loud.double() @ w[:1].T  # [1, 1]
    bound = 2**-8 * ref.abs() + (K // 16 + 64) * 2.0**-23 * (loud.double().abs() @ slack[:1].T)
    assert (y_loud[:, :1].double() - ref).abs() <= bound


def test_nibble_chunk_layout_exactly():
    """Byte i of a 64-column chunk holds the chunk's kept code i (low nibble) and 16 + i (high)."""
    kept = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)  # 2 chunks of 32 kept codes
    kept[0, 32:] = 15 - kept[0, 32:]
    packed = pack_chunks(kept)
    assert packed.shape == (1, 32)
    assert packed[0, 3] == kept[0, 3] | (kept[0, 19] << 4)
    assert packed[0, 16 + 5] == kept[0, 32 + 5] | (kept[0, 32 + 21] << 4)
    assert torch.equal(unpack_chunks(packed), kept)
    # and the kernel reads it so: one kept weight per row, its code visible in y
    N, K, gs = 32, 64, 64
    keep_first_two = torch.zeros(N, K)
    keep_first_two[:, 0::4] = 1
    keep_first_two[:, 1::4] = 1
    _, mask = compress_24(keep_first_two)
    codes = torch.zeros(N, K // 2, dtype=torch.uint8)
    for n in range(N):
        codes[n, n] = 1  # kept code n of row n is 1, every other 0 (zero code 0, scale 1)
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    columns = keep_first_two[0].nonzero()[:, 0]  # the dense column of kept value n
    x[0, columns] = torch.arange(1, N + 1, dtype=torch.bfloat16)
    ones, zeros = torch.ones(N, 1), torch.zeros(N, 1, dtype=torch.uint8)
    y = cpu_sparse.linear_sparse24_quant(x, pack_chunks(codes), mask, ones, zeros, None, 4, gs)
    assert torch.equal(y[0], torch.arange(1, N + 1, dtype=torch.bfloat16))


@pytest.mark.parametrize("bits", [8, 4])
def test_thread_count_and_leading_dims_do_not_change_results(bits):
    g = torch.Generator().manual_seed(5)
    N, K, gs = 1536, 576, 64
    if bits == 8:
        codes, mask, scales, _ = _int8(N, K, gs, g)
        zeros = None
    else:
        codes, mask, scales, zeros, _, _ = _int4(N, K, gs, g)
    x = torch.randn(2, 3, K, generator=g).to(torch.bfloat16)
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(cpu_sparse.linear_sparse24_quant(x, codes, mask, scales, zeros, None, bits, gs))
    finally:
        torch.set_num_threads(old)
    assert outs[0].shape == (2, 3, N) and torch.equal(outs[0], outs[1])
    flat = cpu_sparse.linear_sparse24_quant(x.reshape(6, K), codes, mask, scales, zeros, None, bits, gs)
    assert torch.equal(flat.view(2, 3, N), outs[0])


def test_rejects_what_it_cannot_read():
    g = torch.Generator().manual_seed(0)
    codes, mask, scales, zeros, _, _ = _int4(8, 128, 64, g)
    x = torch.randn(1, 128).to(torch.bfloat16)
    q = cpu_sparse.linear_sparse24_quant
    with pytest.raises(ValueError, match="multiples of 64"):
        q(x, codes, mask, scales, zeros, None, 4, 32)
    with pytest.raises(ValueError, match="zeros must be"):
        q(x, codes, mask, scales, None, None, 4, 64)
    with pytest.raises(ValueError, match="scales must be"):
        q(x, codes, mask, scales.double(), zeros, None, 4, 64)
    with pytest.raises(ValueError, match="mask must be"):
        q(x, codes, mask[:, :-1], scales, zeros, None, 4, 64)
    with pytest.raises(ValueError, match="x .* does not match"):
        q(x[:, :64], codes, mask, scales, zeros, None, 4, 64)
    with pytest.raises(ValueError, match="bias has shape"):
        q(x, codes, mask, scales, zeros, torch.zeros(9, dtype=torch.bfloat16), 4, 64)
    with pytest.raises(ValueError, match="codes must be"):
        q(x, codes.view(torch.int8), mask, scales, zeros, None, 4, 64)


def test_should_use_policy():
    codes8 = torch.zeros(4, 64, dtype=torch.int8)  # K = 128
    codes4 = torch.zeros(4, 32, dtype=torch.uint8)  # K = 128
    x = torch.zeros(8, 128, dtype=torch.bfloat16)
    assert cpu_sparse.should_use_quant(x, codes8, 8, 128) and cpu_sparse.should_use_quant(x, codes4, 4, 64)
    assert not cpu_sparse.should_use_quant(torch.zeros(9, 128, dtype=torch.bfloat16), codes8, 8, 128)  # 9 rows
    assert not cpu_sparse.should_use_quant(x.float(), codes8, 8, 128)
    assert not cpu_sparse.should_use_quant(x, codes8, 8, 32)  # groups of 32: not whole chunks
    assert not cpu_sparse.should_use_quant(x, codes4, 8, 128)  # codes of the other width
    assert not cpu_sparse.should_use_quant(
        torch.zeros(1, 96, dtype=torch.bfloat16), torch.zeros(4, 48, dtype=torch.int8), 8, 96
    )
