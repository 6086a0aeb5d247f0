"""The training forward against the engine's (paged attention) forward, and its loss and gradients."""

import pytest
import torch
import torch.nn.functional as F

from leanlm.model.forward import causal_lm_loss, logits
from tests.compress.conftest import dense_logits


@pytest.mark.parametrize("architecture,kv_heads", [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_logits_match_the_engine_forward(tiny_model, architecture, kv_heads):
    model = tiny_model(torch.float64, architecture=architecture, kv_heads=kv_heads)
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(model, ids), dense_logits(model, ids), rtol=0, atol=1e-10)


def test_a_mixture_of_experts_routes_every_row_of_the_batch(tiny_model):
    """The sparse MLP takes flat rows [B*T, hidden]: the training forward flattens the batch for it."""
    from leanlm.compress import UpcycleConfig, compress

    model = tiny_model(torch.float64)
    compress(model, [UpcycleConfig(num_experts=4, top_k=2, seed=1)], progress=False)
    with torch.no_grad():  # experts that differ, so a row routed wrongly would show
        for e, expert in enumerate(model.model.layers[1].mlp.experts):
            expert.down_proj.weight.mul_(1 + e / 4)
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(model, ids), dense_logits(model, ids), rtol=0, atol=1e-10)


def test_loss_is_next_token_cross_entropy_whatever_the_chunk(tiny_model):
    model = tiny_model(torch.float64)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    full = logits(model, ids)[:, :-1].reshape(-1, 256)
    expected = F.cross_entropy(full, ids[:, 1:].reshape(-1))
    for chunk in (7, 64, 4096):
        torch.testing.assert_close(causal_lm_loss(model, ids, chunk=chunk), expected, rtol=1e-12, atol=0)


def test_every_weight_gets_a_gradient(tiny_model):
    model = tiny_model().train().requires_grad_(True)
    causal_lm_loss(model, torch.randint(0, 256, (2, 16))).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_every_expert_weight_gets_a_gradient_under_bf16_autocast(tiny_model):
    """Flat bf16 rows are what the native SiLU-and-multiply takes, which has no backward: rows autograd records
    (every expert's, and the dense MLP's in the flattened training forward) must stay on torch's ops."""
    from leanlm.compress import UpcycleConfig, compress

    model = tiny_model()
    compress(model, [UpcycleConfig(num_experts=2, top_k=2)], progress=False)
    model.train().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        causal_lm_loss(model, torch.randint(0, 256, (2, 16))).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert [n for n in missing if ".gate." not in n] == []  # identical experts: the router learns from balancing
