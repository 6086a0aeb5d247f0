"""ActSparseLinear: the layer against its reference, untrusted tensors checked, checkpoint round trip, and the
PyTorch path where the kernel is missing."""

import json

import pytest
import torch
import torch.nn.functional as F

from leanlm.formats import save_checkpoint
from leanlm.formats.checkpoint import Checkpoint
from leanlm.kernels import cpu_act_sparse
from leanlm.llm import load_model
from leanlm.model.linear.act_sparse import ActSparseLinear
from leanlm.model.llama import build_model
from tests.conftest import tiny_config, tiny_state_dict


def _linear(n=48, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        linear.bias.copy_(torch.randn(n, generator=g))
    return linear


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_forward_is_the_linear_of_the_sparsified_input(rows):
    linear = _linear()
    x = torch.randn(rows, 64)
    layer = ActSparseLinear.from_linear(linear, 0.5)
    expected = F.linear(x.masked_fill(x.abs() <= 0.5, 0), linear.weight, linear.bias)
    torch.testing.assert_close(layer(x), expected)
    bf16 = ActSparseLinear.from_linear(linear, 0.5, dtype=torch.bfloat16)
    xb = x.bfloat16()  # rounding x can move an entry across the threshold: the reference uses the rounded x
    with torch.inference_mode():
        y = bf16(xb)
    ref = F.linear(cpu_act_sparse.sparsify(xb.float(), 0.5), bf16.weight_t.t().float(), bf16.bias.float())
    torch.testing.assert_close(y.float(), ref, rtol=0.02, atol=0.05)
    if rows <= cpu_act_sparse.MAX_ROWS and cpu_act_sparse.is_available():  # the kernel ran
        kernel = cpu_act_sparse.linear_act_sparse(x.bfloat16(), bf16.weight_t, 0.5, bf16.column_scale, bf16.bias)
        assert torch.equal(y, kernel)


def test_without_the_kernel_the_pytorch_path_runs(monkeypatch):
    layer = ActSparseLinear.from_linear(_linear(), 0.3, dtype=torch.bfloat16)
    x = torch.randn(2, 64).bfloat16()
    monkeypatch.setattr(cpu_act_sparse, "is_available", lambda: False)
    assert layer.native_linear() is None
    expected = F.linear(cpu_act_sparse.sparsify(x, 0.3), layer.weight_t.t(), layer.bias)
    assert torch.equal(layer.column_scale, torch.ones(64))
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize(
    "threshold,message",
    [(torch.tensor([-1.0]), ">= 0"), (torch.tensor([1.0, 2.0]), "values"), (torch.tensor([float("nan")]), "finite")],
)
def test_untrusted_tensors_are_checked(threshold, message):
    with pytest.raises(ValueError, match=message):
        ActSparseLinear(torch.randn(8, 4), threshold, torch.ones(8))
    with pytest.raises(ValueError, match="column_scale"):
        ActSparseLinear(torch.randn(8, 4), torch.tensor([0.5]), -torch.ones(8))


def test_a_checkpoint_with_activation_sparse_layers_loads_back_identical(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer.vocab_size)
    model = build_model(cfg, tiny_state_dict(cfg, seed=2), dtype=torch.bfloat16)
    mlp = model.model.layers[0].mlp
    mlp.down_proj = ActSparseLinear.from_linear(mlp.down_proj, 0.25)
    save_checkpoint(Checkpoint(model, tokenizer), tmp_path)
    meta = json.loads((tmp_path / "quantization_config.json").read_text())
    assert meta["layers"]["model.layers.0.mlp.down_proj"]["format"] == "act_sparse"
    loaded = load_model(str(tmp_path), dtype="bfloat16", progress=False)
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, ActSparseLinear) and down.threshold_value == 0.25
    assert torch.equal(down.weight_t, mlp.down_proj.weight_t)
