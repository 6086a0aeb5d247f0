"""Every compression method on a CUDA model (the loop is device-agnostic): marked `gpu`, skipped without CUDA.

The same tiny float32 model is compressed on the CPU and on the GPU with the same calibration ids; the two must
give the same compressed model up to floating-point order (a weight near a rounding tie of its grid, or a mask
choice near a tie, may come out one step apart), and one as close to the uncompressed model."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress import (
    ActivationSparsityConfig,
    AWQConfig,
    GPTQConfig,
    LLMInt8Config,
    MagnitudeConfig,
    PermuteConfig,
    RTNConfig,
    SmoothQuantConfig,
    SparseGPTConfig,
    WandaConfig,
    compress,
)
from tests.compress.conftest import dense_logits

pytestmark = pytest.mark.gpu

RECIPES = {
    "rtn": [RTNConfig(bits=4, group_size=32)],
    "gptq": [GPTQConfig(bits=4, group_size=32)],
    "awq": [AWQConfig(bits=4, group_size=32)],
    "smoothquant": [SmoothQuantConfig(alpha=0.5)],
    "llm-int8": [LLMInt8Config()],
    "magnitude-2:4": [MagnitudeConfig(pattern="2:4")],
    "wanda-50%": [WandaConfig(sparsity=0.5)],
    "sparsegpt-2:4": [SparseGPTConfig(pattern="2:4")],
    "sparsegpt-2:4-then-gptq": [SparseGPTConfig(pattern="2:4"), GPTQConfig(bits=4, group_size=32)],
    "permute-wanda-2:4": [PermuteConfig(pattern="2:4"), WandaConfig(pattern="2:4")],
    "teal-40%": [ActivationSparsityConfig(sparsity=0.4)],
}


# Searches whose argmin may fall elsewhere on another device (AWQ's grid of scales, folded into the norms).
SEARCHED = {"awq"}


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_method_compresses_a_cuda_model_as_it_does_on_the_cpu(tiny_model, calib, name):
    cpu, gpu = tiny_model(), tiny_model().to("cuda")
    compress(cpu, RECIPES[name], calib, progress=False)
    compress(gpu, RECIPES[name], calib.cuda(), progress=False)
    for (key, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items(), strict=True):
        assert b.is_cuda, f"{key} left the GPU"
        if name in SEARCHED or not a.numel():
            continue
        if a.is_floating_point():
            assert (~torch.isclose(a, b.cpu(), rtol=1e-3, atol=1e-5)).float().mean() < 0.02, key
        else:
            assert (a != b.cpu()).float().mean() < 0.02, key
    ids = calib[:2]
    with torch.no_grad():
        dense = dense_logits(tiny_model(), ids)
        cpu_error = (dense_logits(cpu, ids) - dense).abs().mean()
        gpu_error = (dense_logits(gpu, ids.cuda()).cpu() - dense).abs().mean()
    # a choice near a tie (an outlier column at the threshold, a grid point) moves the logits a little, but the
    # compressed model is as good on either device
    assert gpu_error <= 1.25 * cpu_error + 1e-4, (float(gpu_error), float(cpu_error))
