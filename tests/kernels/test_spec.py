"""KernelSpec: the compiled fast check agrees with the explaining slow path, messages name the tensor and the want,
and the caller refuses an unavailable kernel. No kernel needs to load (nothing here calls one)."""

from pathlib import Path

import pytest
import torch

from leanlm.kernels import cpu_gemv
from leanlm.kernels.build import NativeKernel
from leanlm.kernels.spec import ROWS, Arg, KernelSpec, Rule

_BF16, _U8, _F32 = torch.bfloat16, torch.uint8, torch.float32
_NOWHERE = NativeKernel(
    Path(cpu_gemv.__file__).with_name("gemv_bf16.c"), "leanlm_linear_bf16", [], None, cpu_needs=("no_such_cpu_flag",)
)
# a grouped 4-bit layout: codes [N, K / 2], scales [N, K / G], a 2:4-style mask [N, K / 8], bias [N]
SPEC = KernelSpec(
    _NOWHERE,
    "test kernel",
    [
        Arg("x", _BF16, (ROWS, "K")),
        Arg("codes", _U8, ("N", "K/2")),
        Arg("mask", _U8, ("N", "K/8")),
        Arg("scales", _F32, ("N", "K/G")),
        Arg("bias", _BF16, ("N",), optional=True),
    ],
    given=("G",),
    rules=(
        Rule(("G", "K"), lambda G, K: type(G) is int and G > 0 and G % 32 == 0, "group_size {G!r}: a multiple of 32"),
    ),
)


def _good(N=4, K=64, G=32):
    return [
        torch.zeros(3, K, dtype=_BF16),
        torch.zeros(N, K // 2, dtype=_U8),
        torch.zeros(N, K // 8, dtype=_U8),
        torch.zeros(N, K // G, dtype=_F32),
        torch.zeros(N, dtype=_BF16),
        G,
    ]


def _with(i, value):
    args = _good()
    args[i] = value
    return args


CASES = [
    (_good(), None),
    (_with(4, None), None),  # no bias
    (_with(0, torch.zeros(2, 3, 64, dtype=_BF16)), None),  # any leading dims
    (
        _with(0, torch.zeros(3, 32, dtype=_BF16)),
        r"x has shape \(3, 32\), expected \[\.\.\., 64\]: it does not match codes",
    ),
    (_with(0, torch.zeros(3, 64)), "x must be a contiguous bfloat16 CPU tensor, not torch.float32"),
    (_with(0, torch.zeros(64, 3, dtype=_BF16).t()), "x must be .*, not non-contiguous"),
    (_with(1, torch.zeros(4, 32, dtype=torch.int8)), "codes must be a contiguous uint8"),
    (_with(1, torch.zeros(128, dtype=_U8)), r"codes has shape \(128,\), expected \[N, K/2\]"),
    (_with(2, torch.zeros(4, 7, dtype=_U8)), r"mask has shape \(4, 7\), expected \(4, 8\)"),
    (_with(3, None), "scales must be a contiguous float32 CPU tensor .*, not None"),
    (_with(3, torch.zeros(4, 4, dtype=_F32)), r"scales has shape \(4, 4\), expected \(4, 2\)"),
    (_with(4, torch.zeros(5, dtype=_BF16)), r"bias has shape \(5,\), expected \(4,\)"),
    (_with(5, 48), "group_size 48: a multiple of 32"),
    (_with(5, "32"), "group_size '32'"),
]


@pytest.mark.parametrize(("args", "message"), CASES)
def test_fits_agrees_with_explain(args, message):
    assert SPEC.fits(*args) == (message is None)
    if message is None:
        SPEC.explain(*args)
    else:
        with pytest.raises(ValueError, match=message):
            SPEC.explain(*args)


def test_a_divisor_that_does_not_divide_is_named():
    x, codes, mask = torch.zeros(1, 12, dtype=_BF16), torch.zeros(4, 6, dtype=_U8), torch.zeros(4, 1, dtype=_U8)
    args = [x, codes, mask, torch.zeros(4, 1, dtype=_F32), None, 32]
    spec = KernelSpec(_NOWHERE, "test kernel", SPEC.args, given=("G",))  # no rule: the shapes alone refuse it
    assert not spec.fits(*args)
    with pytest.raises(ValueError, match=r"mask has shape \(4, 1\), expected \[N, K/8\] with 8 \| K = 12"):
        spec.explain(*args)


def test_fits_partial_checks_only_the_tensors_given():
    x, codes, mask, scales, bias, G = _good()
    assert SPEC.fits_partial(None, codes, None, None, None, G)
    assert SPEC.fits_partial(x, codes, mask, None, bias, G)
    assert not SPEC.fits_partial(None, codes, mask[:, :4].contiguous(), None, None, G)
    assert not SPEC.fits_partial(x.float(), codes, None, None, None, G)
    assert SPEC.rows_fit(x, codes, None, None, None, G, max_rows=8)
    assert not SPEC.rows_fit(torch.zeros(9, 64, dtype=_BF16), codes, None, None, None, G, max_rows=8)


def test_an_unavailable_kernel_is_refused_with_its_reason():
    with pytest.raises(RuntimeError, match="test kernel unavailable: .*no_such_cpu_flag"):
        SPEC.linear(*_good()[:1], 4, 64, _good()[:5])
