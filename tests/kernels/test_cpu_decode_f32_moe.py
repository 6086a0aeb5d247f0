"""Mixture-of-experts layers in the float32 native decode loop (decode_layers_f32.c) against the PyTorch path: the
routing (route()'s top-k and scorings, in float32), each chosen expert on its own AVX2 GEMV (float32 and int4
experts), an ungated shared expert, and the loop's counters; hidden states over several decode steps within fp32
rounding at batch 1, 5, 16 and 24."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leanlm.compress import RTNConfig, compress
from leanlm.kernels import cpu_decode
from leanlm.model.llama import build_model
from leanlm.model.moe import moe_blocks
from tests.conftest import tiny_state_dict
from tests.kernels.test_cpu_decode import MOE_CASES, _cache, _config, _decode

pytestmark = pytest.mark.skipif(
    not cpu_decode.is_available(torch.float32), reason="the float32 decode loop needs the AVX2 level"
)


def _moe_model(case: str, kind: str):
    cfg = dataclasses.replace(_config(), moe=MOE_CASES[case])
    model = build_model(cfg, tiny_state_dict(cfg, seed=1), torch.float32)
    if kind == "int4":
        compress(model, [RTNConfig(bits=4, group_size=64)], progress=False)
    return model


@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("kind", ["f32", "int4"])
@pytest.mark.parametrize("batch", [1, 5, 16, 24])  # 24: attention's int4 products in two calls of 16 rows
def test_moe_layers_in_the_float32_loop_match_the_pytorch_path(case, kind, batch):
    model = _moe_model(case, kind)
    plan = model.native_decode_plan()
    assert plan.loop is not None and plan.loop.dtype is torch.float32
    blocks = max(64, 16 * batch)
    native = _decode(model, True, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    reads = [b.stats.native.clone() for b in moe_blocks(model)]
    reference = _decode(model, False, batch, cache=_cache(model, torch.float32, num_blocks=blocks))
    assert native.abs().max() > 0
    torch.testing.assert_close(native, reference, rtol=2e-4, atol=2e-4)
    assert all(int(r[:-2].sum()) == 5 * batch * MOE_CASES[case].top_k for r in reads)  # the loop counted its routing
    assert all(int(r[-2]) == 5 * batch for r in reads)  # tokens


def test_the_float32_loop_routes_as_route_does():
    """leanlm_moe_route_f32 against route(): the same experts and weights on random rows, every scoring."""
    from leanlm.kernels import cpu_rows
    from leanlm.model.moe import route

    gen = torch.Generator().manual_seed(0)
    x, router = torch.randn(37, 64, generator=gen), torch.randn(8, 64, generator=gen)
    for case in MOE_CASES.values():
        moe = dataclasses.replace(case, num_experts=8)
        experts, weights = cpu_rows.moe_route_f32(x, router, moe.top_k, moe.scoring)
        routing = route(x @ router.T, moe)
        order = routing.experts.argsort(dim=-1)  # the kernel lists a token's experts in ascending index order
        assert torch.equal(experts, routing.experts.gather(1, order))
        torch.testing.assert_close(weights, routing.weights.gather(1, order), rtol=1e-5, atol=1e-6)  # fp32 sums
