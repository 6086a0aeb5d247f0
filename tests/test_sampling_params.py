"""SamplingParams refuses what the sampler cannot use: non-finite floats in every float field, out-of-range values."""

from __future__ import annotations

import math

import pytest

from leanlm.sampling_params import SamplingParams

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan])
def test_non_finite_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: bias})


def test_finite_values_and_integers_are_accepted():
    params = SamplingParams(temperature=0, top_p=1, repetition_penalty=2, presence_penalty=-2, logit_bias={5: -100})
    assert params.repetition_penalty == 2 and params.logit_bias == ((5, -100.0),)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [1e-300, 5e-324, 1e300, -1e300])
def test_finite_floats_that_float32_cannot_hold_are_refused(name, value):
    """The sampler holds them as float32: 1e-300 would become 0 (a zero repetition penalty repeats one token for
    ever) and 1e300 inf."""
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("penalty", [1e-3, 0.0099, 100.5, 1e30])
def test_a_repetition_penalty_that_overflows_a_logit_is_refused(penalty):
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=penalty)
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01
    assert SamplingParams(repetition_penalty=100).repetition_penalty == 100


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30, 1.5, True])
def test_seeds_beyond_64_bits_are_refused(seed):
    with pytest.raises(ValueError, match="seed must be None or an integer"):
        SamplingParams(seed=seed)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="lower min_tokens or raise max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
