"""The ISA levels and their switch: how a CPU's flags map to a level, what LEANLM_ISA accepts and what it caps (our
kernels and PyTorch's), and, at every level this CPU offers, the kernels of that level (and none above it)
against the PyTorch reference in a child process (the level is decided once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from leanlm.kernels import isa

ZEN3 = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def test_levels_from_cpu_flags():
    assert isa.cpu_level(frozenset({"sse4_2"})) == "none"
    assert isa.cpu_level(ZEN3) == "avx2"
    assert isa.cpu_level(ZEN4) == "avx512"
    assert isa.cpu_level(SAPPHIRE_RAPIDS) == "amx"
    assert isa.cpu_level(SAPPHIRE_RAPIDS - {"avx2"}) == "none"  # each level needs every level below it


def test_the_switch_reads_levels_and_refuses_others():
    assert isa.requested_cap({}) is None
    assert isa.requested_cap({"LEANLM_ISA": " AVX2 "}) == "avx2"
    with pytest.raises(ValueError, match="not a level: choose one of none, avx2, avx512, amx"):
        isa.requested_cap({"LEANLM_ISA": "avx3"})


def test_torch_imported_first_is_not_capped_and_we_say_so():
    code = "import torch, leanlm; print(torch.backends.cpu.get_cpu_capability())"
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    result = subprocess.run(
        [sys.executable, "-c", code], env={**env, "LEANLM_ISA": "none"}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch was imported before leanlm" in result.stderr


def test_the_switch_caps_torch_unless_the_user_did():
    assert isa.torch_environment({}) == {}
    capped = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert isa.torch_environment({"LEANLM_ISA": "avx2"}) == capped
    assert isa.torch_environment({"LEANLM_ISA": "none", "ATEN_CPU_CAPABILITY": "avx2"}) == {
        "ONEDNN_MAX_CPU_ISA": "SSE41"
    }
    assert isa.torch_environment({"LEANLM_ISA": "amx"}) == {}


# What a child at one level reports: its level, torch's capability, which kernel families load, and the largest
# relative error of an int4 and an int8 layer (bf16 and float32 activations, 1 and 24 rows) against the reference,
# and the bytes of dequantized copies the float32 runs kept.
_CHILD = textwrap.dedent("""
    import json
    import leanlm  # first, as the CLI does: it caps torch at LEANLM_ISA's level before torch loads
    import torch
    from leanlm.kernels import cpu_qgemv, cpu_qgemv_avx2, isa
    from leanlm.model.linear.int8 import Int8WeightOnlyLinear
    from leanlm.model.linear.int_group import IntGroupWeightOnlyLinear
    g = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 256, (96, 64), generator=g, dtype=torch.uint8)
    s = torch.rand(96, 4, generator=g) * 0.02
    layers = [
        IntGroupWeightOnlyLinear(q4, s, -8 * s, bits=4, group_size=32),
        Int8WeightOnlyLinear(torch.randint(-128, 128, (96, 128), generator=g, dtype=torch.int8), s[:, 0] + 1e-3),
    ]
    from leanlm.model.dense_copy import BUDGET
    worst, dense_bytes = 0.0, {}
    for dtype in (torch.float32, torch.bfloat16):
        for layer in layers:
            for rows in (1, 24):
                x = torch.randn(rows, 128, generator=g)
                ref = x.double() @ layer.dequantized_weight().double().T
                y = layer.set_compute_dtype(dtype)(x.to(dtype)).double()
                worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
        dense_bytes[str(dtype)] = BUDGET.held
    print(json.dumps({
        "level": isa.active_level(),
        "torch": torch.backends.cpu.get_cpu_capability(),
        "avx2": cpu_qgemv_avx2.is_available(),
        "avx512": cpu_qgemv.is_available(),
        "reason": cpu_qgemv_avx2.unavailable_reason(),
        "worst": worst,
        "dense_bytes": dense_bytes["torch.float32"],
    }))
""")


def _child(level: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.pop("LEANLM_DISABLE_KERNELS", None)
    env["LEANLM_ISA"] = level
    result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("level", isa.LEVELS)
def test_every_level_this_cpu_offers_matches_the_reference(level):
    cpu = isa.cpu_level()
    if isa.LEVELS.index(level) > isa.LEVELS.index(cpu):
        pytest.skip(f"this CPU's level is {cpu}")
    out = _child(level)
    assert out["level"] == level
    assert out["avx2"] is (level != "none")
    assert out["avx512"] is (level in ("avx512", "amx") and out["avx512"])  # never above the cap
    if level == "none":
        assert out["reason"] == "needs the avx2 level: capped at none by LEANLM_ISA"
        assert out["torch"] == "DEFAULT"  # torch capped with us
        assert out["dense_bytes"] > 0  # no kernel: the layers keep dequantized copies instead of remaking them
    else:
        assert out["dense_bytes"] == 0
    if level == "avx2":
        assert out["torch"] == "AVX2"
    assert out["worst"] < 1e-2  # bf16 activations round to 8 bits; float32 ones agree to ~1e-6
