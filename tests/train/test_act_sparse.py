"""Training with activation sparsity: the small inputs zeroed (by the batch's quantile) with no gradient through
them, every decoder linear sparsified while the run lasts and not after."""

import pytest
import torch
from torch import nn

from leanlm.model.forward import logits
from leanlm.train.act_sparse import TEALTrainConfig, zero_small_inputs
from leanlm.train.recipes import build_sparse_training


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def test_teal_training_zeroes_the_small_inputs_and_passes_no_gradient_through_them():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = zero_small_inputs(x, 0.4)
    zeroed = y == 0
    assert abs(float(zeroed.float().mean()) - 0.4) < 0.02  # the sample's quantile stands for the whole input's
    assert x.detach().abs()[zeroed].max() <= x.detach().abs()[~zeroed].min()  # the smallest, not any 40%
    y.sum().backward()
    assert torch.equal(x.grad, (~zeroed).float())
    assert zero_small_inputs(x, 0.0) is x


def test_teal_training_sparsifies_every_linear_input_during_the_run_only(tiny_model, windows):
    model = tiny_model()
    method = build_sparse_training(TEALTrainConfig(sparsity=0.5))
    method.attach(model)
    multiplied = {}  # what each linear multiplies: a forward hook sees the input after the pre-hooks
    for name, linear in linears(model).items():
        linear.register_forward_hook(lambda m, args, out, name=name: multiplied.__setitem__(name, args[0]))
    logits(model, windows.train[:2])
    assert set(multiplied) == set(linears(model))  # every decoder linear, not the head
    for name, x in multiplied.items():
        assert abs(float((x == 0).float().mean()) - 0.5) < 0.05, name
    assert method.finish() == {"input sparsity": 0.5}
    logits(model, windows.train[:2])
    assert all(float((x == 0).float().mean()) < 0.01 for x in multiplied.values())  # the hooks are gone


def test_teal_training_takes_a_fraction_not_a_pattern():
    with pytest.raises(ValueError, match="not an N:M pattern"):
        TEALTrainConfig(pattern="2:4")
