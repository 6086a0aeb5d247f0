"""Grouped experts (model/experts.py): one grouped product over the rows sorted by expert equals the reference grouping
(StackedLinear.reference_forward per projection) and the per-expert loop, for every runtime weight format the
compression loop makes of experts; the native grouped call runs where it applies (float32 CPU rows), the stacked bmm
form equals the reference, and the grouped forms follow the experts when they change and step aside for hooks and
autograd."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from leanlm.compress import FP8Config, LLMInt8Config, MagnitudeConfig, RTNConfig, compress
from leanlm.config.moe import MoEConfig
from leanlm.kernels import cpu_decode
from leanlm.model.experts import per_expert_forward, stacked_experts, stacked_forward
from leanlm.model.llama import build_model
from leanlm.model.moe import moe_blocks
from tests.conftest import tiny_config, tiny_state_dict

MOE = MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=64)
RECIPES = {
    "float32": [],
    "int4-g32": [RTNConfig(bits=4, group_size=32)],
    "int4-g64": [RTNConfig(bits=4, group_size=64)],
    "int8": [RTNConfig(bits=8, group_size=None)],
    "int8-g32": [RTNConfig(bits=8, group_size=32)],  # GGUF Q8_0's layout
    "fp8": [FP8Config()],
    "llm-int8": [LLMInt8Config()],
    "2:4": [MagnitudeConfig(pattern="2:4")],
}
NATIVE = ("float32", "int4-g32", "int4-g64", "int8", "int8-g32")  # formats with a float32 native call
has_native = pytest.mark.skipif(not cpu_decode.is_available(torch.float32), reason="needs the AVX2 level")


def _block(recipe: str, seed: int = 0):
    config = dataclasses.replace(tiny_config(97), moe=MOE)
    model = build_model(config, tiny_state_dict(config, seed), torch.float32)
    if RECIPES[recipe]:
        calib = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
        compress(model, RECIPES[recipe], calib, progress=False)
    return moe_blocks(model)[0]


def _routed(
    num_rows: int, hidden: int, num_experts: int, seed: int = 1
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """rows [A, hidden] sorted by expert, counts [E] (expert 2 without rows when A < 20), expert ids [A]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_rows,), generator=gen)
    if num_rows < 20:
        ids[ids == 2] = 1
    ids = ids.sort().values
    counts = torch.bincount(ids, minlength=num_experts).tolist()
    return torch.randn(num_rows, hidden, generator=gen), counts, ids


def _reference(block, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The reference grouping: StackedLinear.reference_forward of each projection (the formats' no-kernel paths)."""
    gate, up, down = (type(p[0]).stack(p) for p in zip(*[(e.gate_proj, e.up_proj, e.down_proj) for e in block.experts]))
    return down.reference_forward(F.silu(gate.reference_forward(rows, ids)) * up.reference_forward(rows, ids), ids)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("num_rows", [2, 13, 40])
def test_grouped_experts_equal_the_reference_and_the_per_expert_loop(recipe, num_rows):
    block = _block(recipe)
    rows, counts, ids = _routed(num_rows, 64, MOE.num_experts)
    grouped = block.grouped.forward(block.experts, rows, counts)
    reference = _reference(block, rows, ids)
    scale = reference.abs().max()
    assert scale > 0
    torch.testing.assert_close(grouped, reference, rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(grouped, per_expert_forward(block.experts, rows, counts), rtol=0, atol=2e-5 * scale)
    took_native = block.grouped._native is not None
    assert took_native == (recipe in NATIVE and cpu_decode.is_available(torch.float32)), recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stacked_form_equals_the_reference_and_shares_the_weights(dtype):
    block = _block("float32")
    block.experts.to(dtype)
    rows, counts, ids = _routed(40, 64, MOE.num_experts)
    rows = rows.to(dtype)
    before = [e.gate_proj.weight.detach().clone() for e in block.experts]
    stacks = stacked_experts(block.experts)
    assert stacks is not None and stacks[0].tensors["weight"].shape == (4, 64, 64)
    for e, expert in enumerate(block.experts):  # each expert's weight is now its stack's slice (no second copy)
        assert torch.equal(expert.gate_proj.weight, before[e])
        assert expert.gate_proj.weight.data_ptr() == stacks[0].tensors["weight"][e].data_ptr()
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    reference = _reference(block, rows, ids)
    torch.testing.assert_close(stacked_forward(stacks, rows, counts), reference, rtol=tol, atol=tol)
    assert stacked_experts(torch.nn.ModuleList([_block("int4-g32").experts[0]])) is None  # quantized: no float stack


@has_native
def test_the_grouped_form_follows_the_experts_and_steps_aside_for_hooks_and_autograd():
    block = _block("float32")
    rows, counts, ids = _routed(13, 64, MOE.num_experts)
    first = block.grouped.forward(block.experts, rows, counts)
    with torch.no_grad():
        block.experts[1].up_proj.weight.mul_(2)  # an in-place edit: the native call must read the new weights
    edited = block.grouped.forward(block.experts, rows, counts)
    torch.testing.assert_close(edited, _reference(block, rows, ids), rtol=0, atol=1e-5 * edited.abs().max())
    assert not torch.allclose(edited, first)
    seen = []
    handle = block.experts[3].down_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    block.grouped.forward(block.experts, rows, counts)
    handle.remove()
    assert seen == [counts[3]]  # the hooked expert ran through its own module (calibration observers see its rows)
    trained = rows.clone().requires_grad_(True)
    block.grouped.forward(block.experts, trained, counts).sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


def test_the_block_output_is_unchanged_by_grouping():
    """A whole block on float32 rows: the grouped dispatch against the per-expert loop it replaced."""
    block = _block("int4-g32")
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        grouped = block(x)
        block.experts[0].gate_proj.register_forward_pre_hook(lambda m, i: None)  # forces the per-expert loop
        looped = block(x)
    torch.testing.assert_close(grouped, looped, rtol=0, atol=2e-5 * looped.abs().max())


@has_native
def test_the_grouped_form_follows_the_activation_mode():
    """The step's activation mode changes which kernels a layer runs: the native grouped call is remade with them,
    and again when the mode changes back."""
    from leanlm.model.linear.act_quant import activation_quant

    block = _block("int4-g32")
    rows, counts, _ = _routed(13, 64, MOE.num_experts)
    block.grouped.forward(block.experts, rows, counts)
    assert not any(lin.name.endswith("a8_f32") for lin in block.grouped._native.linears)
    with activation_quant("int8"):
        looped = per_expert_forward(block.experts, rows, counts)
        grouped = block.grouped.forward(block.experts, rows, counts)
        assert all(lin.name.endswith("a8_f32") for lin in block.grouped._native.linears)
    torch.testing.assert_close(grouped, looped, rtol=0, atol=1e-4 * looped.abs().max())
    block.grouped.forward(block.experts, rows, counts)
    assert not any(lin.name.endswith("a8_f32") for lin in block.grouped._native.linears)
