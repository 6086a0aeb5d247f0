"""A linear's description for the native decode loop: each kernel module's calls check the tensors its entry reads,
and the loop itself knows no weight format."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from leanlm.kernels import cpu_decode, cpu_gemv, cpu_qgemv, native_linear
from leanlm.model.layers import Linear
from leanlm.model.linear.int8 import Int8WeightOnlyLinear

KERNELS = Path(cpu_decode.__file__).parent


def test_the_loop_has_no_format_switch_and_reads_no_private_kernel():
    source = (KERNELS / "decode_layers.c").read_text()
    assert "KIND" not in source and "switch" not in source
    python = (KERNELS / "cpu_decode.py").read_text()
    assert not re.search(r"\b(cpu_\w+|paged_attention)\._[A-Za-z]", python)


def test_the_ctypes_mirror_is_eight_byte_fields():
    # linear_call.h: fn + 6 tensors + 2 ints; decode_linear: N, K, perm + two calls
    assert ctypes.sizeof(native_linear._Call) == 8 * (1 + native_linear.MAX_TENSORS + native_linear.MAX_INTS)
    assert ctypes.sizeof(native_linear._Linear) == 8 * 3 + 2 * ctypes.sizeof(native_linear._Call)


def test_calls_refuse_tensors_their_kernel_does_not_read():
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert cpu_gemv.native_call(w, None) is not None
    assert cpu_gemv.native_call(w.float(), None) is None
    assert cpu_gemv.native_call(w, torch.zeros(64)) is None  # a float32 bias
    assert cpu_gemv.native_call(w, torch.zeros(32, dtype=torch.bfloat16)) is None  # a bias of the wrong length
    q, s = torch.zeros(64, 64, dtype=torch.int8), torch.ones(64)
    assert cpu_qgemv.int8_native_call(q, s, None, None).ints == (64,)  # per channel: one group of K
    assert cpu_qgemv.int8_native_call(q, s, None, 32) is None  # per-channel scales for a group size
    assert cpu_qgemv.int8_native_call(q, torch.ones(64, 2), None, 32).ints == (32,)


def test_a_layer_describes_itself_only_where_its_kernels_take_it():
    layer = Linear(32, 64, dtype=torch.float32)
    assert layer.native_linear() is None  # float32: no bf16 GEMV
    layer = layer.to(torch.bfloat16)
    native = layer.native_linear()
    if not cpu_gemv.is_available():
        pytest.skip("no bf16 GEMV here: the call exists but is not supported")
    assert native.name == "bf16" and native.many_rows is None and native.is_supported()
    int8 = Int8WeightOnlyLinear(torch.zeros(64, 32, dtype=torch.int8), torch.ones(64), torch.zeros(64))
    assert int8.native_linear() is None  # a float32 bias: the GEMV reads bf16
    int8.set_compute_dtype(torch.bfloat16)
    assert int8.native_linear().name == "int8"


def test_describe_needs_the_many_row_call_for_a_batched_loop():
    call = cpu_gemv.native_call(torch.zeros(8, 8, dtype=torch.bfloat16), None)
    assert native_linear.describe(8, 8, call, None, packed=True) is None
    assert native_linear.describe(8, 8, None, call, packed=False) is None
    assert native_linear.describe(8, 8, call, call, packed=False).many_rows is None
