"""The batched LoRA product: both paths (a product per run of rows, one masked product over the stacked slots) equal
scale * (x A^T) B^T row by row, whatever the slots' ranks, dtypes and rows without an adapter."""

from __future__ import annotations

import pytest
import torch

from leanlm.config import ModelConfig
from leanlm.model.lora import LoRAMapping, LoRARun, LoRASlots, lora_delta, lora_target_shapes
from tests.conftest import tiny_config

SHAPES = {"m.q": (48, 32), "m.down": (32, 80)}


def _adapter(gen, rank: int, names=SHAPES) -> dict:
    return {n: (torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen), 0.5 + rank / 8)
            for n, (o, i) in names.items()}  # fmt: skip


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_both_paths_equal_the_reference_per_row(stacked, dtype, atol):
    gen = torch.Generator().manual_seed(0)
    slots = LoRASlots(SHAPES, num_slots=4, max_rank=8, dtype=dtype, device="cpu")
    adapters = {0: _adapter(gen, 8), 2: _adapter(gen, 3), 1: _adapter(gen, 5, {"m.q": SHAPES["m.q"]})}
    for slot, weights in adapters.items():
        slots.set_slot(slot, weights)
    # rows 0-2 adapter in slot 2, 3-4 none, 5 slot 0, 6-9 slot 1 (no m.down), 10 slot 0 with its own scale
    runs = (LoRARun(0, 3, 2, 1.0), LoRARun(5, 6, 0, 1.0), LoRARun(6, 10, 1, 1.0), LoRARun(10, 11, 0, -2.0))
    mapping = LoRAMapping.of(slots, runs, 12, stacked=stacked)
    assert (mapping.row_scales is not None) is stacked
    for name, (out_f, in_f) in SHAPES.items():
        x = torch.randn(12, in_f, generator=gen, dtype=dtype)
        y = torch.randn(12, out_f, generator=gen, dtype=dtype)
        want = y.clone()
        for run in runs:
            if name in adapters[run.slot]:
                a, b, scale = adapters[run.slot][name]
                rows = slice(run.start, run.end)
                want[rows] += lora_delta(x[rows], a.to(dtype), b.to(dtype), scale * run.scale)
        torch.testing.assert_close(mapping.apply(name, x, y), want, atol=atol, rtol=0)


def test_a_slot_reused_for_an_adapter_of_other_modules_forgets_the_old_ones():
    gen = torch.Generator().manual_seed(1)
    slots = LoRASlots(SHAPES, 2, 4, torch.float64, "cpu")
    slots.set_slot(0, _adapter(gen, 4))
    slots.set_slot(0, _adapter(gen, 2, {"m.q": SHAPES["m.q"]}))
    mapping = LoRAMapping.of(slots, (LoRARun(0, 2, 0, 1.0),), 2)
    x, y = torch.randn(2, 80, dtype=torch.float64), torch.randn(2, 32, dtype=torch.float64)
    torch.testing.assert_close(mapping.apply("m.down", x, y), y)  # m.down's rows were zeroed


def test_no_run_is_no_mapping_and_bad_runs_are_refused():
    slots = LoRASlots(SHAPES, 2, 4, torch.float32, "cpu")
    assert LoRAMapping.of(slots, (), 5) is None
    with pytest.raises(ValueError, match="does not fit"):
        LoRAMapping.of(slots, (LoRARun(0, 6, 0, 1.0),), 5)
    with pytest.raises(ValueError, match="do not fit"):
        slots.set_slot(0, {"m.q": (torch.zeros(5, 32), torch.zeros(48, 5), 1.0)})  # rank 5 > 4


def test_targets_are_attention_and_dense_mlp_linears():
    config: ModelConfig = tiny_config(100)
    shapes = lora_target_shapes(config)
    assert len(shapes) == 2 * 7
    assert shapes["model.layers.1.self_attn.k_proj"] == (32, 64)  # 2 KV heads x 16
    assert shapes["model.layers.0.mlp.down_proj"] == (64, 128)
