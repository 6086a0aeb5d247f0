"""Every compression method runs through a MoE model's experts like any MLP (each expert its own linear group,
calibrated on the tokens routed to it), leaves the router in float, and the checkpoint loads back with the same
logits."""

import dataclasses

import pytest
import torch

from leanlm.compress import (
    FP8Config,
    GPTQConfig,
    LLMInt8Config,
    MagnitudeConfig,
    RTNConfig,
    SparseGPTConfig,
    WandaConfig,
    compress,
)
from leanlm.config.moe import MoEConfig
from leanlm.formats import load_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.formats.native import save_checkpoint
from leanlm.model.layers import Linear
from leanlm.model.llama import build_model
from leanlm.model.moe import Router, moe_blocks
from tests.compress.conftest import VOCAB, dense_logits
from tests.conftest import tiny_config, tiny_state_dict

MOE = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=64, shared_expert_intermediate_size=64)

RECIPES = {
    "rtn-int4": [RTNConfig(bits=4, group_size=32)],
    "gptq-int4": [GPTQConfig(bits=4, group_size=32)],
    "int8": [RTNConfig(bits=8)],
    "fp8": [FP8Config()],
    "llm-int8": [LLMInt8Config()],
    "2:4-magnitude": [MagnitudeConfig(pattern="2:4")],
    "2:4-sparsegpt": [SparseGPTConfig(pattern="2:4")],
    "wanda-50%": [WandaConfig(sparsity=0.5)],
}


def moe_model(seed: int = 0):
    config = dataclasses.replace(tiny_config(VOCAB), moe=MOE)
    return build_model(config, tiny_state_dict(config, seed), torch.float32)


@pytest.mark.parametrize("name", list(RECIPES))
def test_experts_compress_and_round_trip(name, calib, tmp_path, tokenizer):
    model = moe_model()
    before = dense_logits(model, calib)
    compress(model, RECIPES[name], calib, progress=False)
    for block in moe_blocks(model):
        assert type(block.gate) is Router and block.gate.weight.dtype == torch.float32
        if name in ("rtn-int4", "gptq-int4", "int8", "fp8", "llm-int8"):  # every expert became a runtime layer
            assert not any(type(m) is Linear for m in block.experts.modules())
    after = dense_logits(model, calib)
    assert 0 < (after - before).abs().max() and torch.isfinite(after).all()
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path, dtype=torch.float32)
    loaded = load_checkpoint(tmp_path, torch.float32, "cpu", progress=False).model
    assert loaded.config.moe == MOE
    torch.testing.assert_close(dense_logits(loaded, calib), after, atol=1e-5, rtol=0)


def test_an_expert_no_calibration_token_reached_is_rounded_not_erased():
    """GPTQ's Hessian of an expert the router never chose is empty: it must round the expert (H = I), not zero it
    as if every input were dead."""
    from leanlm.compress.hessian import prepare_hessian

    weight = torch.randn(8, 16)
    h, w = prepare_hessian(torch.zeros(16, 16), weight, 0.01)
    assert torch.equal(h, torch.eye(16, dtype=torch.float64)) and torch.equal(w, weight.double())
    dead_one = torch.eye(16)
    dead_one[3, 3] = 0
    assert (prepare_hessian(dead_one, weight, 0.01)[1][:, 3] == 0).all()  # a dense layer's dead input: as before
